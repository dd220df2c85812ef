"""Speculative decoding: the config (`config.py`), the proposers (`ngram.py`), exact rejection sampling
(`rejection.py`) and the acceptance metrics (`metrics.py`). The verify forward and the KDA RecoverSSM commit
live in the model and the kernels (`kernels/kda`, `kernels/conv`, `kernels/mla` `*_verify` / `*_commit`).
Design: docs/design/spec_decode.md."""
