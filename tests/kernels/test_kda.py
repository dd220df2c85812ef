"""KDA: the chunked WY form and pooled decode agree with the token-by-token recurrence; states carry
across calls; in-pass checkpoints equal the final state of a call over just the prefix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3serve.kernels.kda import chunk_kda, kda_decode, kda_gate, recurrent_kda

from _close import assert_close

H, K, V = 3, 16, 32
LENS = [1, 63, 64, 65, 130]  # around the 64-token chunk edge
TOL = 1e-5


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0)


def _inputs(T: int, lower_bound: float | None = None, B: int = 1, dtype: torch.dtype = torch.float32):
    """Random (q, k, v, g, beta) [B, T, ...]; g through kda_gate with per-head A_log, per-channel dt_bias."""
    q, k = torch.randn(B, T, H, K, dtype=dtype), torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, H, V, dtype=dtype)
    g = kda_gate(torch.randn(B, T, H, K), torch.rand(H) * 2 - 1, torch.randn(H * K), lower_bound)
    beta = torch.rand(B, T, H)
    return q, k, v, g, beta


def _assert_results_close(ref: tuple, out: tuple, tol: float = TOL) -> None:
    for name, r, o in zip(("o", "final_state", "checkpoints"), ref, out):
        if r is None:
            assert o is None, name
        else:
            assert_close(name, r, o, tol, tol)


@pytest.mark.parametrize("chunk_size", [64, 16], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("with_h0", [False, True], ids=["h0-zero", "h0-random"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["gate-softplus", "gate-safe-5"])
def test_chunk_matches_recurrent_varlen(lower_bound: float | None, with_h0: bool, chunk_size: int) -> None:
    q, k, v, g, beta = _inputs(sum(LENS), lower_bound)
    h0 = torch.randn(len(LENS), H, K, V) if with_h0 else None
    args = dict(initial_state=h0, cu_seqlens=_cu(LENS), use_qk_l2norm_in_kernel=True)
    ref = recurrent_kda(q, k, v, g, beta, **args)
    _assert_results_close(ref, chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, **args))


def test_batch_rows_equal_packed_sequences_and_explicit_scale_and_l2norm() -> None:
    """B rows without cu_seqlens are N = B sequences; l2norm in the kernel equals normalizing first."""
    q, k, v, g, beta = _inputs(70, B=2)
    h0 = torch.randn(2, H, K, V)
    batched = chunk_kda(q, k, v, g, beta, 0.3, h0, use_qk_l2norm_in_kernel=True)
    qn, kn = F.normalize(q, dim=-1, eps=0), F.normalize(k, dim=-1, eps=0)
    flat = lambda t: t.reshape(1, -1, *t.shape[2:])  # noqa: E731
    packed = recurrent_kda(flat(qn), flat(kn), flat(v), flat(g), flat(beta), 0.3, h0, _cu([70, 70]))
    assert_close("o", packed[0].reshape(2, 70, H, V), batched[0], TOL, TOL)
    assert_close("final_state", packed[1], batched[1], TOL, TOL)
    assert batched[2] is None


def _varlen_call(kda, seqs: list[tuple[torch.Tensor, ...]], h0: torch.Tensor):
    """One packed call over per-sequence (q, k, v, g, beta) tuples of [1, L_n, ...]; o comes back split."""
    lens = [seq[0].shape[1] for seq in seqs]
    packed = [torch.cat(parts, 1) for parts in zip(*seqs)]
    o, final, _ = kda(*packed, initial_state=h0, cu_seqlens=_cu(lens), use_qk_l2norm_in_kernel=True)
    return o.split(lens, 1), final


@pytest.mark.parametrize("kda", [chunk_kda, recurrent_kda], ids=["chunk", "recurrent"])
def test_two_calls_carrying_final_state_equal_one_call(kda) -> None:
    inputs = _inputs(sum(LENS))
    cu = _cu(LENS).tolist()
    seqs = [tuple(t[:, s:e] for t in inputs) for s, e in zip(cu[:-1], cu[1:])]
    h0 = torch.randn(len(LENS), H, K, V)
    o_one, final_one = _varlen_call(kda, seqs, h0)

    cut = [1, 20, 64, 33, 100]  # tokens per sequence in the first call; sequence 0 ends there
    o_first, mid = _varlen_call(kda, [tuple(t[:, :c] for t in seq) for seq, c in zip(seqs, cut)], h0)
    rest = [n for n, (c, L) in enumerate(zip(cut, LENS)) if c < L]
    o_rest, end = _varlen_call(kda, [tuple(t[:, cut[n] :] for t in seqs[n]) for n in rest], mid[rest])
    o_second = dict(zip(rest, o_rest))
    final_two = mid.clone()
    final_two[rest] = end
    for n in range(len(LENS)):
        o_two = torch.cat([o_first[n], *([o_second[n]] if n in o_second else [])], 1)
        assert_close(f"o[{n}]", o_one[n], o_two, TOL, TOL)
    assert_close("final_state", final_one, final_two, TOL, TOL)


@pytest.mark.parametrize("kda", [chunk_kda, recurrent_kda], ids=["chunk", "recurrent"])
def test_checkpoint_equals_final_state_of_the_prefix(kda) -> None:
    # per sequence: last token (len 1), inside a chunk, on a chunk boundary, none, inside the 3rd chunk
    lens, offsets = [1, 63, 130, 65, 200], [1, 17, 64, -1, 150]
    q, k, v, g, beta = _inputs(sum(lens), lower_bound=-5.0)
    cu = _cu(lens)
    h0 = torch.randn(len(lens), H, K, V)
    _, _, checkpoints = kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                            checkpoint_offsets=torch.tensor(offsets), use_qk_l2norm_in_kernel=True)
    for n, (start, off) in enumerate(zip(cu[:-1].tolist(), offsets)):
        if off == -1:
            assert torch.equal(checkpoints[n], torch.zeros(H, K, V))
            continue
        prefix = [t[:, start : start + off] for t in (q, k, v, g, beta)]
        _, prefix_state, _ = recurrent_kda(*prefix, initial_state=h0[n : n + 1], use_qk_l2norm_in_kernel=True)
        assert_close(f"checkpoint[{n}] at {off}", prefix_state[0], checkpoints[n], TOL, TOL)


def test_decode_over_poisoned_pool_equals_recurrent_steps() -> None:
    N, steps, num_slots = 4, 6, 12
    q, k, v, g, beta = _inputs(steps, B=N)
    h0 = torch.randn(N, H, K, V)
    ref_o, ref_final, _ = recurrent_kda(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True)

    slots = torch.tensor([9, 2, 11, 5])
    pool = torch.full((num_slots, H, K, V), 1e30)
    pool[slots] = h0
    o = torch.stack([kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], pool, slots,
                                use_qk_l2norm_in_kernel=True) for t in range(steps)], 1)
    assert_close("o", ref_o, o, TOL, TOL)
    assert_close("state", ref_final, pool[slots], TOL, TOL)
    unused = torch.ones(num_slots, dtype=torch.bool)
    unused[slots] = False
    assert (pool[unused] == 1e30).all()


def test_decode_applies_the_beta_sigmoid_itself_when_asked() -> None:
    """use_beta_sigmoid_in_kernel: beta comes as logits (the layer's projection) and the step is the same."""
    q, k, v, g, _ = _inputs(1, B=3)
    logits = torch.randn(3, 1, H)
    slots = torch.tensor([0, 2, 1])
    pool = torch.randn(3, H, K, V)
    ref_pool = pool.clone()
    o = kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], logits[:, 0], pool, slots, use_beta_sigmoid_in_kernel=True)
    ref_o = kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], torch.sigmoid(logits[:, 0]), ref_pool, slots)
    assert torch.equal(o, ref_o) and torch.equal(pool, ref_pool)


def test_bf16_inputs_give_bf16_output_and_fp32_state() -> None:
    q, k, v, g, beta = _inputs(80, dtype=torch.bfloat16)
    o, final, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert (o.dtype, final.dtype) == (torch.bfloat16, torch.float32)
    ref = recurrent_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert_close("o", ref[0], o, 1e-2, 1e-2)  # one bf16 rounding of o
    assert_close("final_state", ref[1], final, TOL, TOL)


def test_gate_forms() -> None:
    f, A_log, dt_bias = torch.randn(2, 5, H, K), torch.randn(H), torch.randn(H, K)
    a = A_log.exp()[:, None]
    assert_close("softplus", -a * F.softplus(f + dt_bias), kda_gate(f, A_log, dt_bias), 1e-6, 1e-6)
    safe = kda_gate(f.bfloat16(), A_log, dt_bias.flatten(), -5.0)
    assert safe.dtype == torch.float32
    assert_close("safe", -5.0 * torch.sigmoid(a * (f.bfloat16().float() + dt_bias)), safe, 1e-6, 1e-6)
    assert ((safe > -5.0) & (safe < 0)).all()


def test_bad_arguments_raise_clear_errors() -> None:
    q, k, v, g, beta = _inputs(10)
    cu = _cu([4, 6])
    with pytest.raises(ValueError, match=r"lower_bound must be in \[-5, 0\)"):
        kda_gate(torch.randn(H, K), torch.zeros(H), torch.zeros(H * K), -6.0)
    with pytest.raises(ValueError, match=r"A_log must be \[H=3\]"):
        kda_gate(torch.randn(H, K), torch.zeros(K), torch.zeros(H * K))
    with pytest.raises(ValueError, match="g must match q"):
        chunk_kda(q, k, v, g[..., :8], beta)
    with pytest.raises(ValueError, match="g .log decay. must be float32"):
        chunk_kda(q, k, v, g.bfloat16(), beta)
    with pytest.raises(ValueError, match=r"beta must be \[B, T, H\]"):
        chunk_kda(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="varlen .cu_seqlens. needs B == 1"):
        chunk_kda(*(torch.cat([t, t]) for t in (q, k, v, g, beta)), cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly from 0 to T=10"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=_cu([4, 5]))
    with pytest.raises(ValueError, match="initial_state must have N=2 rows"):
        chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(1, H, K, V), cu_seqlens=cu)
    with pytest.raises(ValueError, match="initial_state must be float32"):
        chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(2, H, K, V).bfloat16(), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"checkpoint_offsets must be -1 or in \[1, len_n\]"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=cu, checkpoint_offsets=torch.tensor([5, -1]))
    with pytest.raises(ValueError, match=r"checkpoint_offsets must be -1 or in \[1, len_n\]"):
        recurrent_kda(q, k, v, g, beta, cu_seqlens=cu, checkpoint_offsets=torch.tensor([0, 6]))
    pool = torch.zeros(4, H, K, V)
    step = [t[0, :2] for t in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="state_pool must be float32"):
        kda_decode(*step, pool.double(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="distinct slots"):
        kda_decode(*step, pool, torch.tensor([3, 3]))
