"""On CUDA an engine planned out of a device budget runs its warm-up step at start and checks it against the plan:
the step measured is the largest the plan sizes, within the plan's prefill reserve; and a plan that under-estimates
that step (its prefill reserve a quarter of the estimate) fails the start with `MemoryPlanError`, planned vs measured
in the message.

Model: `K3_TINY_GPU`, bf16, so the step runs the GPU kernels the estimate describes (fla, SDPA, the Triton MoE).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import k3serve.engine.memory as memory
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.memory import max_step_tokens
from k3serve.engine.warmup import MemoryPlanError
from k3serve.kernels import kda, mla, moe

pytestmark = pytest.mark.gpu

ENGINE_ARGS = dict(device="cuda", dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=2048,
                   max_num_seqs=4, max_num_batched_tokens=2048, max_adaptive_batched_tokens=4096,
                   gpu_memory_utilization=0.3)


@pytest.fixture(autouse=True)
def _free_device() -> None:
    """The plan reads the device's free memory: an earlier engine's pools, cached by the allocator, would shrink it."""
    gc.collect()
    torch.cuda.empty_cache()


def test_an_engine_planned_from_the_device_checks_its_warm_up_step_against_the_plan(
        k3_tiny_gpu_checkpoint: Path) -> None:
    engine = LLMEngine(EngineArgs(model=str(k3_tiny_gpu_checkpoint), **ENGINE_ARGS))
    peak = engine.warmup
    assert peak is not None, "the start ran no warm-up check"
    assert (kda.last_backend["chunk_kda"], mla.last_backend["mla_prefill_attention"],
            moe.last_backend["fused_experts"]) == ("fla", "sdpa", "triton"), "not the kernels the estimate describes"
    assert peak.planned_bytes == engine.plan.prefill_bytes > 0
    assert (peak.num_tokens, peak.num_seqs) == (max_step_tokens(engine.args, None), 4) == (4096, 4)
    print(f"\nwarm-up step of {peak.num_tokens} tokens: {peak.measured_bytes / 2**20:.1f} MiB measured, "
          f"{peak.planned_bytes / 2**20:.1f} MiB planned")
    assert 0 < peak.measured_bytes <= peak.planned_bytes and peak.within_plan


def test_a_plan_that_under_estimates_the_step_fails_the_start_loudly(k3_tiny_gpu_checkpoint: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate cut to a quarter: the same warm-up step exceeds it (the measured step takes at least half of
    what the estimate counts: test_prefill_memory_gpu.py), and the engine does not start."""
    estimate = memory.prefill_activation_bytes
    monkeypatch.setattr(memory, "prefill_activation_bytes", lambda *a, **kw: estimate(*a, **kw) // 4)
    with pytest.raises(MemoryPlanError, match=r"warm-up step of 4096 tokens in 4 sequences took [\d.]+ MiB, the plan "
                                              r"set aside [\d.]+ MiB"):
        LLMEngine(EngineArgs(model=str(k3_tiny_gpu_checkpoint), **ENGINE_ARGS))
