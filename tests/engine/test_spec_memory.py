"""Specification: the memory plan of a speculative engine. Its largest step samples up to 1 + K rows a request and
holds every KDA layer's verify records until the commit: the prefill estimate grows by exactly them (K3 at TP8,
16 requests, K = 8), and only with speculative_config."""

from __future__ import annotations

from k3serve.engine.config import EngineArgs
from k3serve.engine.memory import prefill_phase_bytes, verify_records_bytes
from k3serve.model.checkpoint import preset_hf_config
from k3serve.model.config import ModelConfig


def test_the_memory_plan_counts_verify_rows_logits_and_records() -> None:
    config = ModelConfig.from_hf_dict(preset_hf_config("kimi-k3"))
    plain = dict(model="k3-tiny", tensor_parallel_size=8, dtype="bfloat16", max_num_seqs=16)
    spec = plain | {"speculative_config": {"method": "ngram", "num_speculative_tokens": 8}}
    before, after = (prefill_phase_bytes(config, EngineArgs(**a), 141 << 30) for a in (plain, spec))
    assert after["kda"] - before["kda"] == verify_records_bytes(config, 8, 16 * 9, 2) > 0
    assert after["sampling"] == 9 * before["sampling"]  # 16 x 9 sampled rows instead of 16
