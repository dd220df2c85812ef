"""KDA on the GPU (fla's chunked prefill with in-pass checkpoints, our Triton pooled decode) against the fp32
torch reference, at the benchmarked shapes (8K tokens; 12 heads = one K3 rank at TP8, 32, 96 = K3 whole;
decode batch 1-64). Checkpoints come from fla's bf16 chunk-start states plus an fp32 in-chunk update:
a prefill resumed from one must be as close to the unsplit fp32 reference as the unsplit kernel is."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels import kda
from k3serve.kernels.kda import chunk_kda, kda_decode, kda_gate, naive

from _close import assert_rel_rms

pytestmark = pytest.mark.gpu

K = V = 128
POISON = 1e30
TOL = 1e-2  # bf16 q, k, v and bf16 intermediates inside fla: relative RMS error lands at a few 1e-3
RESUME_SLACK = 1.25  # a resumed prefill's error may exceed the unsplit kernel's by at most 25% (+1e-4)


def _inputs(T: int, H: int, B: int = 1, dev: str = "cuda"):
    """bf16 q, k, v; K3 bounded gate g in (-5, 0) fp32; beta in (0, 1)."""
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    f = torch.randn(B, T, H, K, device=dev)
    g = kda_gate(f, torch.rand(H, device=dev) * 2 - 1, torch.randn(H * K, device=dev), -5.0)
    beta = torch.rand(B, T, H, device=dev)
    return q, k, v, g, beta


def _leave_nan_blocks(shape: tuple[int, ...], count: int) -> None:
    """Free `count` NaN-filled fp32 blocks of `shape` into torch's caching allocator: outputs of that size
    allocated empty next (final state, checkpoints) land on them, so a row no kernel writes reads NaN,
    not a lucky zero of fresh memory."""
    blocks = [torch.full(shape, float("nan"), device="cuda") for _ in range(count)]
    del blocks


@pytest.mark.parametrize(("H", "safe_gate"), [(12, True), (12, False), (32, True)],
                         ids=["H12-safe-gate", "H12-plain-gate", "H32-safe-gate"])
def test_chunk_8k_varlen_checkpoints(H: int, safe_gate: bool) -> None:
    """8192 tokens as 4 sequences with random fp32 initial states; checkpoints mid-chunk, on a chunk
    edge, at the very end, and none (a zero row, written by the checkpoint kernel over reused memory)."""
    lens = [3001, 64, 1000, 4127]
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0)
    q, k, v, g, beta = _inputs(sum(lens), H)
    h0 = torch.randn(len(lens), H, K, V, device="cuda")
    offsets = torch.tensor([1500, 64, -1, 4127], device="cuda")
    args = dict(initial_state=h0, cu_seqlens=cu, checkpoint_offsets=offsets, use_qk_l2norm_in_kernel=True)
    _leave_nan_blocks(tuple(h0.shape), 2)
    o, final, checkpoints = chunk_kda(q, k, v, g, beta, gate_lower_bound=-5.0 if safe_gate else None, **args)
    assert kda.last_backend["chunk_kda"] == "fla"
    assert final.dtype == checkpoints.dtype == torch.float32
    ref_o, ref_final, ref_cp = naive.chunk_kda(q, k, v, g, beta, **args)
    assert_rel_rms("o", ref_o, o, TOL)
    assert_rel_rms("final_state", ref_final, final, TOL)
    wanted = offsets >= 0
    assert_rel_rms("checkpoints", ref_cp[wanted], checkpoints[wanted], TOL)
    assert torch.equal(checkpoints[~wanted], torch.zeros_like(checkpoints[~wanted]))


def test_checkpoint_kernel_is_fp32_exact() -> None:
    """The checkpoint kernel alone, on given bf16 chunk states, keys and v_new, within 1e-5 of the fp64 reference:
    its in-chunk sum must run as 3xTF32. The prefill tests above cannot tell: fla's bf16 states put their error
    at a few 1e-3, where 1xTF32's ~6e-5 hides."""
    from _kda_checkpoint_cases import check_checkpoints_match_reference  # imports triton

    check_checkpoints_match_reference("cuda")


@pytest.mark.parametrize("H", [12, 32, 96], ids=lambda h: f"H{h}")
def test_resume_from_checkpoint_matches_unsplit_reference(H: int) -> None:
    """8192 tokens, checkpoint mid-chunk at 4113; the second half run again from the checkpoint gives
    output and final state within TOL of the unsplit fp32 reference, and no further from it than the
    unsplit kernel's own output and final state are."""
    T, cut = 8192, 4113
    q, k, v, g, beta = _inputs(T, H)
    h0 = torch.randn(1, H, K, V, device="cuda")
    common = dict(use_qk_l2norm_in_kernel=True, gate_lower_bound=-5.0)
    o, final, checkpoint = chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=torch.tensor([0, T]),
                                     checkpoint_offsets=torch.tensor([cut]), **common)
    assert kda.last_backend["chunk_kda"] == "fla"
    rest = [t[:, cut:] for t in (q, k, v, g, beta)]
    o_resumed, final_resumed, _ = chunk_kda(*rest, initial_state=checkpoint, cu_seqlens=torch.tensor([0, T - cut]),
                                            **common)
    ref_o, ref_final, ref_cp = naive.chunk_kda(q, k, v, g, beta, None, h0, torch.tensor([0, T], device="cuda"),
                                               torch.tensor([cut], device="cuda"), True)
    assert_rel_rms("checkpoint", ref_cp, checkpoint, TOL)
    for name, ref, unsplit, resumed in (("o after the checkpoint", ref_o[:, cut:], o[:, cut:], o_resumed),
                                        ("final_state", ref_final, final, final_resumed)):
        err_unsplit = assert_rel_rms(f"{name}, unsplit", ref, unsplit, TOL)
        err_resumed = assert_rel_rms(f"{name}, resumed", ref, resumed, TOL)
        assert err_resumed <= RESUME_SLACK * err_unsplit + 1e-4, (
            f"{name}: resumed from the checkpoint {err_resumed:.3e} vs unsplit {err_unsplit:.3e}")


def test_prefill_with_host_indices_never_syncs() -> None:
    """Host cu_seqlens and checkpoint offsets: once compiled, a chunked prefill with checkpoints runs
    without a single device synchronization (torch's sync debug mode raises on one), and is right."""
    lens = [3001, 64, 1000, 4127]
    q, k, v, g, beta = _inputs(sum(lens), 12)
    h0 = torch.randn(len(lens), 12, K, V, device="cuda")
    args = dict(initial_state=h0, cu_seqlens=torch.tensor([0, *lens]).cumsum(0),
                checkpoint_offsets=torch.tensor([1500, 64, -1, 4127]), use_qk_l2norm_in_kernel=True)
    chunk_kda(q, k, v, g, beta, gate_lower_bound=-5.0, **args)  # compile / autotune (these do sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, final, checkpoints = chunk_kda(q, k, v, g, beta, gate_lower_bound=-5.0, **args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kda.last_backend["chunk_kda"] == "fla"
    ref_o, ref_final, ref_cp = naive.chunk_kda(q, k, v, g, beta, **args)
    assert_rel_rms("o", ref_o, o, TOL)
    assert_rel_rms("final_state", ref_final, final, TOL)
    assert_rel_rms("checkpoints", ref_cp[[0, 1, 3]], checkpoints[[0, 1, 3]], TOL)
    assert torch.equal(checkpoints[2], torch.zeros_like(checkpoints[2]))


def test_prefill_with_device_indices_and_a_plan_never_syncs() -> None:
    """Device cu_seqlens and offsets (as a model layer holds them) with the batch's chunk plan: the
    tensors are trusted, the plan's host lists used, nothing is read back; the results are the same."""
    lens, offsets = [3001, 64, 1000, 4127], [1500, 64, -1, 4127]
    q, k, v, g, beta = _inputs(sum(lens), 12)
    h0 = torch.randn(len(lens), 12, K, V, device="cuda")
    args = dict(initial_state=h0, cu_seqlens=torch.tensor([0, *lens], device="cuda").cumsum(0),
                checkpoint_offsets=torch.tensor(offsets, device="cuda"), use_qk_l2norm_in_kernel=True)
    want = chunk_kda(q, k, v, g, beta, gate_lower_bound=-5.0, **args)  # compiles; reads the tensors back
    plan = kda.plan_chunks(lens, True, offsets, kda.CHUNK_SIZE, q.device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = chunk_kda(q, k, v, g, beta, gate_lower_bound=-5.0, plan=plan, **args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kda.last_backend["chunk_kda"] == "fla"
    for name, w, o in zip(("o", "final_state", "checkpoints"), want, got):
        assert_rel_rms(name, w, o, 1e-5)  # the same kernels (a different autotuned config at most)


def test_chunk_batch_rows_no_state() -> None:
    """B = 2 rows without cu_seqlens, zero initial state, explicit scale, no checkpoints."""
    q, k, v, g, beta = _inputs(1000, 12, B=2)
    o, final, checkpoints = chunk_kda(q, k, v, g, beta, 0.05, use_qk_l2norm_in_kernel=True, gate_lower_bound=-5.0)
    assert kda.last_backend["chunk_kda"] == "fla" and checkpoints is None
    ref_o, ref_final, _ = naive.chunk_kda(q, k, v, g, beta, 0.05, use_qk_l2norm_in_kernel=True)
    assert_rel_rms("o", ref_o, o, TOL)
    assert_rel_rms("final_state", ref_final, final, TOL)


@pytest.mark.parametrize("N", [1, 4, 16, 64], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("H", [12, 32], ids=lambda h: f"H{h}")
def test_decode_pool_in_place(H: int, N: int) -> None:
    """Our Triton step on a pool 3x the batch, unused slots poisoned, q/k/v strided views of one projection
    (as the layer passes them): used slots advance exactly like the reference, the rest stay bit-identical."""
    num_slots = 3 * N + 1
    pool = torch.full((num_slots, H, K, V), POISON, device="cuda")
    slots = torch.randperm(num_slots, device="cuda")[:N]
    pool[slots] = torch.randn(N, H, K, V, device="cuda")
    _, _, _, g, beta = (t[0] for t in _inputs(N, H))
    proj = torch.randn(N, H * (2 * K + V), device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.reshape(N, H, -1) for t in proj.split([H * K, H * K, H * V], dim=-1))
    ref_pool = pool.clone()
    o = kda_decode(q, k, v, g, beta, pool, slots, use_qk_l2norm_in_kernel=True)
    assert kda.last_backend["kda_decode"] == "triton"
    ref_o = naive.kda_decode(q, k, v, g, beta, ref_pool, slots, None, True)
    assert_rel_rms("o", ref_o, o, TOL)
    assert_rel_rms("state", ref_pool[slots], pool[slots], 1e-5)
    unused = torch.ones(num_slots, dtype=torch.bool, device="cuda")
    unused[slots] = False
    assert torch.equal(pool[unused], ref_pool[unused])


def test_decode_applies_the_beta_sigmoid_in_the_kernel() -> None:
    """use_beta_sigmoid_in_kernel as the KDA layer calls it: beta's bf16 logits a column slice of the same
    projection as q, k, v; the Triton step applies the sigmoid in fp32 and advances like the reference given
    sigmoid(logits)."""
    N, H = 16, 12
    pool = torch.randn(N + 1, H, K, V, device="cuda")
    slots = torch.randperm(N + 1, device="cuda")[:N]
    g = _inputs(N, H)[3][0]
    proj = torch.randn(N, H * (2 * K + V + 1), device="cuda", dtype=torch.bfloat16)
    q, k, v, b = (t.reshape(N, H, -1) for t in proj.split([H * K, H * K, H * V, H], dim=-1))
    ref_pool = pool.clone()
    o = kda_decode(q, k, v, g, b[..., 0], pool, slots, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert kda.last_backend["kda_decode"] == "triton"
    ref_o = naive.kda_decode(q, k, v, g, torch.sigmoid(b[..., 0].float()), ref_pool, slots, None, True)
    assert_rel_rms("o", ref_o, o, TOL)
    assert_rel_rms("state", ref_pool, pool, 1e-5)


def test_prefill_then_decode_continues_the_state() -> None:
    """Prefill's fp32 final state feeds decode: 200 prefill tokens + 1 decode token == 201 tokens."""
    H = 12
    q, k, v, g, beta = _inputs(201, H)
    _, final, _ = chunk_kda(*(t[:, :200] for t in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)
    pool = final.clone()
    o = kda_decode(q[0, 200:], k[0, 200:], v[0, 200:], g[0, 200:], beta[0, 200:], pool,
                   torch.tensor([0], device="cuda"), use_qk_l2norm_in_kernel=True)
    ref_o, ref_final, _ = naive.recurrent_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert_rel_rms("o_decode", ref_o[0, 200:], o, TOL)
    assert_rel_rms("state", ref_final, pool, TOL)


def test_fp32_inputs_fall_back_to_the_reference() -> None:
    """fla takes bf16/fp16 only: fp32 inputs run the reference, and say so."""
    q, k, v, g, beta = (t.float() if t.dtype == torch.bfloat16 else t for t in _inputs(70, 2))
    chunk_kda(q, k, v, g, beta)
    assert kda.last_backend["chunk_kda"] == "naive"
