"""Specification of the stacked input projections: the projections that read the same input run as one GEMM
over one stacked weight (KDA: q, k, v, f_a, b and the output gate; MLA: q or q_a, kv_a and g; MoE: the latent
down-projection and the shared experts' gate and up; a dense MLP: gate and up). The per-name parameters,
which the loader fills by the published names (this rank's shard), are views of the stack's rows: no
second copy, and a reload writes the stack in place, where CUDA graphs captured over it read it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from k3serve.engine.cuda_graphs import DecodeGraphs
from k3serve.engine.scheduler_output import ScheduledSeq
from k3serve.kernels.moe import silu_glu
from k3serve.model.batch import ModelCache
from k3serve.model.checkpoint import make_checkpoint
from k3serve.model.layers.common import Linear
from k3serve.model.layers.kda import KimiDeltaAttention
from k3serve.model.layers.mla import MLAAttention
from k3serve.model.layers.mlp import DenseMLP, SparseMoE
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM
from k3serve.model.parallel import TensorParallel
from k3serve.model.presets import K3_TINY_GPU, preset_hf_config
from k3serve.model.weights import load_weights
from tiny_presets import kimi_linear_tiny

from _checkpoint_files import read_tensor
from _runs import allocate, assert_logits_close, run_alone, run_in_chunks


def _stacks(model: KimiForCausalLM) -> list[tuple[str, torch.Tensor, list[Linear]]]:
    """(module name, stacked weight, the projections it stacks in row order) of every module that stacks."""
    found = []
    for name, m in model.named_modules():
        if isinstance(m, KimiDeltaAttention):
            gate = m.g_proj if hasattr(m, "g_proj") else m.g_a_proj
            found.append((name, m.x_proj_weight, [m.q_proj, m.k_proj, m.v_proj, m.f_a_proj, m.b_proj, gate]))
        elif isinstance(m, MLAAttention):
            q = m.q_proj if hasattr(m, "q_proj") else m.q_a_proj
            found.append((name, m.x_proj_weight, [q, m.kv_a_proj_with_mqa] + ([m.g_proj] if hasattr(m, "g_proj") else [])))
        elif isinstance(m, SparseMoE):
            down = [m.routed_expert_down_proj] if hasattr(m, "routed_expert_down_proj") else []
            shared = [m.shared_experts.gate_proj, m.shared_experts.up_proj] if hasattr(m, "shared_experts") else []
            if down + shared:
                found.append((name, m.x_proj_weight, down + shared))
        elif isinstance(m, DenseMLP) and m.stack_gate_up:
            found.append((name, m.gate_up_weight, [m.gate_proj, m.up_proj]))
    return found


def _assert_rows_of_stack(name: str, stack: torch.Tensor, projections: list[Linear]) -> None:
    start = 0
    for proj in projections:
        w = proj.weight
        assert w.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr(), f"{name}: not in the stack"
        assert w.data_ptr() == stack[start].data_ptr() and w.shape == stack[start : start + w.shape[0]].shape, name
        start += w.shape[0]
    assert start == stack.shape[0], f"{name}: the stack has rows no projection owns"


@pytest.fixture(scope="module")
def other_k3_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3-tiny with other random weights: what a reload brings."""
    return make_checkpoint("k3-tiny", tmp_path_factory.mktemp("k3-tiny-seed1"), seed=1)


@pytest.mark.parametrize("fixture", ["tiny_checkpoint", "kimi_linear_tiny_checkpoint"])
@pytest.mark.parametrize("rank", [0, 1], ids=["tp1", "tp2-rank1"])
def test_per_name_weights_are_views_of_one_stack_no_second_copy(
    request: pytest.FixtureRequest, fixture: str, rank: int
) -> None:
    tp = TensorParallel(rank, 2) if rank else TensorParallel()
    model = load_model(request.getfixturevalue(fixture), tp, dtype=torch.bfloat16)
    stacks = _stacks(model)
    assert len(stacks) == 2 * model.config.num_hidden_layers  # attention, and MoE or dense MLP, in every layer
    for name, stack, projections in stacks:
        _assert_rows_of_stack(name, stack, projections)
    params = list(model.parameters())
    held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    assert sum(held.values()) == sum(p.nbytes for p in params)  # the stacks hold nothing beyond the parameters


@pytest.mark.parametrize("fixture", ["tiny_checkpoint", "kimi_linear_tiny_checkpoint"])
def test_one_gemm_over_the_stack_gives_each_projection(request: pytest.FixtureRequest, fixture: str) -> None:
    model = load_model(request.getfixturevalue(fixture))  # fp32: only the GEMM's blocking may differ
    for name, stack, projections in _stacks(model):
        x = torch.randn(5, stack.shape[1])
        together = torch.nn.functional.linear(x, stack).split([p.weight.shape[0] for p in projections], dim=-1)
        for proj, out in zip(projections, together):
            torch.testing.assert_close(out, proj(x), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("rank", [0, 1], ids=["tp1", "tp2-rank1"])
def test_reload_through_the_loader_refills_the_stacks_in_place(
    tiny_checkpoint: Path, other_k3_tiny: Path, rank: int
) -> None:
    tp = TensorParallel(rank, 2) if rank else TensorParallel()
    model = load_model(tiny_checkpoint, tp, dtype=torch.bfloat16)
    before = {name: (stack.data_ptr(), stack.clone()) for name, stack, _ in _stacks(model)}
    load_weights(model, other_k3_tiny)
    model.process_weights_after_loading()

    for name, stack, projections in _stacks(model):
        assert stack.data_ptr() == before[name][0], f"{name}: the stack moved"
        assert not torch.equal(stack, before[name][1]), f"{name}: the stack kept its old values"
        _assert_rows_of_stack(name, stack, projections)
    # the rows hold this rank's shard of the reloaded checkpoint's tensor, e.g. layer 0's KDA q_proj
    kda = model.model.layers[0].self_attn
    full = read_tensor(other_k3_tiny, f"{model.config.weight_prefix}model.layers.0.self_attn.q_proj.weight")
    rows = kda.q_proj.weight.shape[0]
    assert torch.equal(kda.x_proj_weight[:rows], full[rank * rows : (rank + 1) * rows].to(torch.bfloat16))
    if rank == 0:  # and the model computes what a fresh load of that checkpoint computes
        tokens = torch.randint(0, model.config.vocab_size, (9,)).tolist()
        fresh = load_model(other_k3_tiny, dtype=torch.bfloat16)
        assert torch.equal(run_alone(model, tokens), run_alone(fresh, tokens))


def test_a_replaced_parameter_is_stacked_again_at_the_same_address(tiny_checkpoint: Path) -> None:
    """As `Module.to` replaces each parameter's tensor: processing again puts it back into the stack."""
    model = load_model(tiny_checkpoint)
    kda = model.model.layers[0].self_attn
    stack, ptr = kda.x_proj_weight, kda.x_proj_weight.data_ptr()
    new_k = kda.k_proj.weight.detach() + 1.0
    kda.k_proj.weight.data = new_k.clone()
    model.process_weights_after_loading()
    assert kda.x_proj_weight.data_ptr() == ptr
    rows = kda.q_proj.weight.shape[0]
    assert torch.equal(stack[rows : 2 * rows], new_k)
    assert kda.k_proj.weight.data_ptr() == stack[rows].data_ptr()  # a view of its rows again


def _without_shared_experts(hf: dict) -> dict:
    text = hf.get("text_config", hf)
    text["num_shared_experts"] = 0
    return hf


@pytest.mark.parametrize("hf", [_without_shared_experts(preset_hf_config("k3-tiny")),
                                _without_shared_experts(kimi_linear_tiny())], ids=["latent", "plain"])
def test_moe_without_shared_experts_stacks_what_it_has(tmp_path: Path, hf: dict) -> None:
    model = load_model(make_checkpoint(hf, tmp_path, seed=0))
    moe = next(m for m in model.modules() if isinstance(m, SparseMoE))
    if model.config.routed_expert_hidden_size is None:
        assert moe.x_proj_weight is None  # nothing to stack: the routed experts read x itself
    else:
        _assert_rows_of_stack("latent MoE", moe.x_proj_weight, [moe.routed_expert_down_proj])
    tokens = torch.randint(0, model.config.vocab_size, (12,)).tolist()
    chunked = run_in_chunks(model, allocate(model), tokens, [7, 1, 1, 3])
    assert_logits_close("prefill + decode vs one pass", run_alone(model, tokens), chunked)


GRAPH_BLOCK = 16  # the Triton MLA decode wants a power of 2 >= 16


def _decode_graphs(checkpoint: Path, device: str, capture: bool) -> DecodeGraphs:
    """Batch-1 decode graphs over a freshly loaded bf16 model and a cache with the same random context
    every time; recorded (`capture`) or not, in which case `run` runs the very same step eagerly."""
    model = load_model(checkpoint, dtype=torch.bfloat16, device=device)
    cache = ModelCache.allocate(model.config, 2, 1, GRAPH_BLOCK, 1, torch.bfloat16, device, reserve_pad_slot=True)
    gen = torch.Generator(device=device).manual_seed(0)
    for pool in cache.mla_kv + cache.kda_conv:
        pool.normal_(generator=gen)
    for pool in cache.kda_recurrent:
        pool.normal_(0.0, 0.05, generator=gen)
    graphs = DecodeGraphs(model, cache, (1,), max_blocks=1)
    if capture:
        graphs.capture()  # runs padding rows only: the context of slot 0 and block 0 stays as filled
    return graphs


def _reload_under_a_captured_graph(tmp_path: Path, device: str, capture: bool) -> None:
    first, second = (make_checkpoint(copy.deepcopy(K3_TINY_GPU), tmp_path / f"seed{s}", seed=s) for s in (0, 1))
    seq = ScheduledSeq("s", [7], 5, [0], 0, is_prefill=False, needs_sample=True)
    graphs = _decode_graphs(first, device, capture)
    load_weights(graphs.model, second)
    graphs.model.process_weights_after_loading()
    replayed = graphs.run([seq]).clone()
    assert graphs.replays[1] == int(capture)
    expected = _decode_graphs(second, device, capture=False).run([seq])
    stale = _decode_graphs(first, device, capture=False).run([seq])
    torch.testing.assert_close(replayed, expected, rtol=2e-2, atol=2e-2)  # bf16: as the graph-vs-eager tests
    assert not torch.allclose(replayed, stale, rtol=2e-2, atol=2e-2), "the graph read the weights of the first load"


def test_a_dense_mlp_computes_down_of_act_of_gate_and_up_stacked_or_not() -> None:
    """stack_gate_up=False (the owner stacks gate and up, as SparseMoE does its shared experts): `forward`
    gives what the stacked MLP gives, down(silu(gate x) * up x)."""
    gen = torch.Generator().manual_seed(0)
    gate, up, down, x = (torch.randn(*shape, generator=gen) for shape in [(16, 8), (16, 8), (8, 16), (5, 8)])
    want = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
    for stacked in (True, False):
        mlp = DenseMLP(8, 16, silu_glu, TensorParallel(), torch.float32, stack_gate_up=stacked)
        for linear, weight in [(mlp.gate_proj, gate), (mlp.up_proj, up), (mlp.down_proj, down)]:
            linear.weight.copy_(weight)
        torch.testing.assert_close(mlp(x), want, msg=f"stack_gate_up={stacked}")


@pytest.mark.gpu
def test_a_captured_decode_graph_reads_the_reloaded_stacks(tmp_path: Path) -> None:
    """keep_address end to end: the graph recorded over the first load's stacks (and every other weight)
    computes, after a reload through the loader, what a fresh load of the new checkpoint computes."""
    _reload_under_a_captured_graph(tmp_path, "cuda", capture=True)
