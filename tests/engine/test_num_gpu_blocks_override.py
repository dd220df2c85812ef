"""`num_gpu_blocks_override` (vLLM's `--num-gpu-blocks-override`) fixes how many MLA KV blocks an engine makes, on
CPU too: exactly that many, the KDA slots as without it; more than its cache budget holds, or fewer than one request
of max_model_len needs, fails at the plan with the field's name."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.memory import plan_engine_pools
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.presets import preset_config

ARGS = dict(block_size=16, max_model_len=256, max_num_seqs=4, cache_memory_bytes=16 << 20)


def test_the_plan_makes_exactly_the_blocks_asked_and_the_same_slots() -> None:
    config = preset_config("k3-tiny")
    full = plan_engine_pools(config, EngineArgs(**ARGS))
    fixed = plan_engine_pools(config, EngineArgs(**ARGS, num_gpu_blocks_override=40))
    assert fixed.num_blocks == 40 < full.num_blocks
    assert fixed.num_slots == full.num_slots


@pytest.mark.parametrize("blocks, problem", [
    (10**9, r"num_gpu_blocks_override=1000000000: the cache budget of 16.0 MiB holds \d+ blocks of 16 tokens"),
    (15, "num_gpu_blocks_override=15: one request of max_model_len=256 needs 16 blocks of 16 tokens"),
    (0, "num_gpu_blocks_override must be an integer >= 1 or None, got 0"),
])
def test_a_count_the_budget_or_one_request_cannot_take_fails_naming_the_field(blocks: int, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        plan_engine_pools(preset_config("k3-tiny"), EngineArgs(**ARGS, num_gpu_blocks_override=blocks))


def test_an_engine_serves_out_of_exactly_those_blocks(tiny_checkpoint: Path) -> None:
    llm = LLM(model=str(tiny_checkpoint), **ARGS, num_gpu_blocks_override=16)  # one full-length request
    assert llm.engine.scheduler.block_pool.num_blocks == 16
    assert llm.engine.settings()["num_gpu_blocks"] == "16"
    (out,) = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out.outputs[0].token_ids) == 4
