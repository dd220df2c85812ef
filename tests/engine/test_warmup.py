"""The start's memory check, decided on CPU: which engines run a warm-up step, the step it runs (the largest the
memory plan sizes, within the pools), and that a step above the plan beyond the tolerance fails with planned vs
measured in the message. (That a CUDA engine runs it and passes, or fails under an under-estimating plan:
test_warmup_gpu.py.)"""

from __future__ import annotations

import pytest

from k3serve.engine.config import EngineArgs
from k3serve.engine.memory import PoolPlan, max_step_tokens
from k3serve.engine.warmup import (WARMUP_TOLERANCE, MemoryPlanError, WarmupPeak, check_warmup_peak,
                                   warmup_output, warmup_skip_reason)
from k3serve.kernels._backend import reference_kernels

PLAN = PoolPlan(num_blocks=40, num_slots=6, block_size=16, prefill_bytes=100 * 2**20)
ARGS = dict(device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=600,
            max_adaptive_batched_tokens=1000, num_kda_slots=6)


def test_a_peak_within_the_tolerance_passes_and_one_beyond_it_fails_naming_both_numbers() -> None:
    planned = 100 * 2**20
    check_warmup_peak(WarmupPeak(planned, planned, 1000, 4))
    check_warmup_peak(WarmupPeak(planned, int(planned * (1 + WARMUP_TOLERANCE)), 1000, 4))
    with pytest.raises(MemoryPlanError, match=r"step of 1000 tokens in 4 sequences took 110\.0 MiB, the plan set "
                                              r"aside 100\.0 MiB \(tolerance 1%\)"):
        check_warmup_peak(WarmupPeak(planned, 110 * 2**20, 1000, 4))


def test_the_warm_up_step_is_the_largest_step_the_plan_sizes() -> None:
    """max_step_tokens (1000) in max_num_seqs (4) sampled sequences: one as long as a prompt may be (511), the rest
    sharing the remaining 489; fresh KDA slots, block tables covering each sequence within the pool."""
    args = EngineArgs(**ARGS)
    output = warmup_output(args, PLAN, vocab_size=1000, device_bytes=None)
    lengths = [len(s.token_ids) for s in output.seqs]
    assert lengths == [511, 163, 163, 163] and output.num_batched_tokens == max_step_tokens(args, None) == 1000
    assert all(s.is_prefill and s.needs_sample and s.zero_state and s.num_computed_tokens == 0 for s in output.seqs)
    assert [s.slot_id for s in output.seqs] == [0, 1, 2, 3]
    for seq in output.seqs:
        assert len(seq.block_ids) == -(-len(seq.token_ids) // PLAN.block_size) == len(set(seq.block_ids))
        assert all(0 <= b < PLAN.num_blocks for b in seq.block_ids)
        assert all(0 <= t < 1000 for t in seq.token_ids)
    assert len({t for s in output.seqs for t in s.token_ids}) > 100  # varied tokens: the MoE routes them apart


def test_sequences_that_cannot_hold_the_budget_run_what_they_hold() -> None:
    """Two sequences of at most 511 tokens cannot run a 2000-token budget: the step is what the scheduler could run."""
    args = EngineArgs(**{**ARGS, "max_num_seqs": 2, "max_num_batched_tokens": 2000,
                         "max_adaptive_batched_tokens": 2000})
    assert [len(s.token_ids) for s in warmup_output(args, PLAN, 1000, None).seqs] == [511, 511]


def test_only_a_16_bit_engine_whose_plan_reserved_a_step_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import k3serve.engine.warmup as warmup

    monkeypatch.setattr(warmup, "has_module", lambda name: True)  # as on a GPU host with fla installed
    assert warmup_skip_reason(EngineArgs(**ARGS), PLAN) is None
    assert "no prefill reserve" in warmup_skip_reason(EngineArgs(**ARGS), PoolPlan(40, 6, 16))
    assert "16-bit" in warmup_skip_reason(EngineArgs(**{**ARGS, "dtype": "float32"}), PLAN)
    with reference_kernels():
        assert "reference kernels are forced" in warmup_skip_reason(EngineArgs(**ARGS), PLAN)
    monkeypatch.setattr(warmup, "has_module", lambda name: name != "fla")
    assert "fla is not installed" in warmup_skip_reason(EngineArgs(**ARGS), PLAN)
