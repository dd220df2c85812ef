"""Prefill worker: chunked prefill with the adaptive budget, KDA checkpoints, boundary-state export."""
