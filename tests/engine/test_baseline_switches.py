"""The optimisations' baseline switches (EngineArgs fields the GPU serving benchmark sets per run): each one is a
real, working path that changes what it says, and serves the same greedy tokens.

    adaptive_token_budget=False  the step budget stays max_num_batched_tokens (no raise while few requests run)
    moe_finalize="unfused"       the routed experts' top-k sum runs after their kernels, not inside them
    kernels="reference"          every op's torch reference in the engine's thread, and no CUDA graphs
(kda_checkpoint_mode="align" and enforce_eager are the other two: tests/engine/test_llm_correctness.py,
tests/engine/test_cuda_graphs_gpu.py.)"""

from __future__ import annotations

import threading
from functools import partial

import pytest
import torch

from k3serve.engine.config import EngineArgs
from k3serve.engine.cuda_graphs import graphs_off_reason
from k3serve.engine.sampling_params import SamplingParams
from k3serve.kernels import _backend, moe
from k3serve.kernels.moe import ExpertWeights, fused_experts, situ_glu
from k3serve.kernels.mxfp4 import quantize_mxfp4

from _llm_harness import make_llm  # noqa: F401  (fixture)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(40 + 9 * i)] for i in range(3)]


# ---- static token budget --------------------------------------------------------------------
def test_the_static_budget_schedules_two_prompts_that_the_adaptive_one_takes_together(make_scheduler, h) -> None:
    budgets = {}
    for adaptive in (True, False):
        scheduler = make_scheduler(max_num_batched_tokens=128, adaptive_token_budget=adaptive)
        for rid in ("a", "b"):
            scheduler.add_request(h.request(f"{rid}-{adaptive}", 100))
        output, _ = h.step(scheduler)
        budgets[adaptive] = (output.token_budget, output.num_batched_tokens)
        h.run_to_completion(scheduler)
    assert budgets[True] == (200, 200)  # both prompts whole in one pass, the budget raised for them
    assert budgets[False] == (128, 128)  # the first whole, the second split: the budget stays the base


def test_a_static_budget_with_a_ceiling_is_refused() -> None:
    with pytest.raises(ValueError, match="adaptive_token_budget=False"):
        EngineArgs(adaptive_token_budget=False, max_adaptive_batched_tokens=4096)


# ---- unfused MXFP4 finalize -----------------------------------------------------------------
def _expert_bank(num_experts: int = 6, inter: int = 64, dim: int = 64) -> ExpertWeights:
    gen = torch.Generator().manual_seed(3)
    def bank(out_f: int, in_f: int):
        return quantize_mxfp4(torch.randn(num_experts, out_f, in_f, generator=gen) / in_f**0.5)
    return ExpertWeights(w1=bank(inter, dim), w3=bank(inter, dim), w2=bank(dim, inter))


def test_the_unfused_finalize_sums_after_the_experts_and_equals_the_fused_one() -> None:
    weights, gen = _expert_bank(), torch.Generator().manual_seed(4)
    x = torch.randn(5, 64, generator=gen)
    topk_ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(5)])  # ids 6, 7: another rank's
    topk_weights = torch.rand(5, 3, generator=gen)
    act = partial(situ_glu, beta=4.0, linear_beta=25.0)
    fused = fused_experts(x, weights, topk_weights, topk_ids, act)
    assert moe.last_backend["moe_finalize"] == "fused"
    unfused = fused_experts(x, weights, topk_weights, topk_ids, act, finalize="unfused")
    assert moe.last_backend["moe_finalize"] == "unfused"
    torch.testing.assert_close(unfused, fused, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="finalize must be"):
        fused_experts(x, weights, topk_weights, topk_ids, act, finalize="later")


def test_an_engine_with_the_unfused_finalize_runs_it_and_serves_the_same_tokens(make_llm) -> None:
    fused = [o.outputs[0].token_ids for o in make_llm().generate(PROMPTS, GREEDY)]
    moe.last_backend.clear()
    unfused = [o.outputs[0].token_ids for o in make_llm(moe_finalize="unfused").generate(PROMPTS, GREEDY)]
    assert moe.last_backend["moe_finalize"] == "unfused"
    assert unfused == fused


# ---- reference kernels ----------------------------------------------------------------------
def test_reference_kernels_turn_cuda_graphs_off() -> None:
    args = dict(device="cuda", dtype="bfloat16")
    assert graphs_off_reason(EngineArgs(**args)) is None
    assert graphs_off_reason(EngineArgs(**args, kernels="reference")) == "reference kernels forced"


def test_an_engine_with_reference_kernels_forces_them_in_its_steps_alone(make_llm) -> None:
    seen: list[bool] = []
    llm = make_llm(kernels="reference")
    model = llm.engine.runner.model
    for module in list(model.modules())[1:]:  # the submodules its forward calls
        module.register_forward_pre_hook(lambda *_: seen.append(_backend.reference_forced()))
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert seen and all(seen)  # every forward ran with the GPU kernels refused (on CUDA: the torch reference)
    assert not _backend.reference_forced()  # ... and only while it ran
    other_thread: list[bool] = []
    with _backend.reference_kernels_in_thread():
        worker = threading.Thread(target=lambda: other_thread.append(_backend.reference_forced()))
        worker.start()
        worker.join()
    assert other_thread == [False]  # an engine of ours beside it in the same process keeps our kernels
    assert out == [o.outputs[0].token_ids for o in make_llm().generate(PROMPTS, GREEDY)]


def test_the_memory_plan_sets_aside_the_unfused_finalizes_intermediates() -> None:
    from k3serve.engine.memory import prefill_activation_bytes
    from k3serve.model.presets import preset_config

    config = preset_config("k3-rank-slice")
    args = dict(device="cuda", max_num_batched_tokens=8192, max_model_len=16384)
    fused = prefill_activation_bytes(config, EngineArgs(**args), 141 << 30)
    unfused = prefill_activation_bytes(config, EngineArgs(**args, moe_finalize="unfused"), 141 << 30)
    pairs = 16384 * 2  # the adaptive ceiling's tokens, top-2
    assert unfused - fused == pairs * 3584 * (2 + 8)  # bf16 x a pair, fp32 outputs and weighted products
