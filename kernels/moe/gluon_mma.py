"""MXFP4 (w4a16) routed experts on the tensor cores for decode batches whose hit experts have a few rows each,
written in Gluon (`triton.experimental.gluon`): `mma_v2` (m16n8k16) with swapped operands, A = 64 rows of the
expert's weights, B = up to 8 of its token rows (the MMA's N), so the weights are read once per 8 rows.

    up kernel:   h[pair] = act(x[tok] W1[e]^T, x[tok] W3[e]^T)      bf16, the GLU in the epilogue
    down kernel: out[tok] += topk_weight[pair] · h[pair] W2[e]^T     fp32 atomics (weighting and top-k sum fused)

The packed bytes go from global memory straight into the MMA's operand registers (no shared memory), the e2m1
codes upcast by bit fields and each group's E8M0 scale applied exactly to its fp32 partial sums. Routing
(`triton_moe.route` / `route_small`) is read on the device; programs past the active experts exit at once: no
host sync, graph-capturable. Where it sits beside the GEMV and tensor-core pairs, the k order, the upcast and
the scales: docs/design/moe_gluon_mma.md.
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from k3serve.kernels.mxfp4 import MXFP4Tensor

ROWS = 64  # weight rows a program: 4 warps, one m16 tile each
TOKENS = 8  # token rows an MMA takes (its N): an expert with more runs its tiles of 8 in turn
NUM_WARPS = 4

# The accumulator [64 rows, 8 tokens] and the MMA operands laid on it.
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8]))
_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2))  # [64, 32] bf16 codes
_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2))  # [32, 8] bf16 activations
# A group's packed words as loaded: [warp 4, row bit 2, lane row 8, lane col 4], one 32-bit word (8 codes) a row.
_LOAD_A = gl.constexpr(gl.BlockedLayout([1, 2, 1, 1], [1, 1, 8, 4], [4, 1, 1, 1], [3, 2, 1, 0]))
# A group's activations as loaded: [token 8, lane col 4, code 8], 8 adjacent bf16 a lane (every warp the same).
_LOAD_B = gl.constexpr(gl.BlockedLayout([1, 1, 8], [8, 4, 1], [1, 1, 4], [2, 1, 0]))
_ROW = gl.constexpr(gl.SliceLayout(1, _MMA))  # [64] rows of the accumulator
_TOKEN = gl.constexpr(gl.SliceLayout(0, _MMA))  # [8] token columns of the accumulator
_B_TOKEN = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, _LOAD_B)))  # [8] tokens of the loaded activations


@gluon.jit
def _a_offsets(stride_row):
    """[4, 2, 8, 4] word offsets in a 64-row tile of group 0 (stride_row in words): row 16w + 8b + r, word c."""
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, _LOAD_A))))
    b = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, _LOAD_A))))
    r = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, _LOAD_A))))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, _LOAD_A))))
    row = w[:, None, None, None] * 16 + b[None, :, None, None] * 8 + r[None, None, :, None]
    return row.to(gl.int64) * stride_row + c[None, None, None, :]


@gluon.jit
def _b_offsets(token_offsets):
    """[8, 4, 8] element offsets of group 0's activations: token t's row (token_offsets [8]), code 8c + i."""
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, _LOAD_B)))
    i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _LOAD_B)))
    return token_offsets[:, None, None] + c[None, :, None] * 8 + i[None, None, :]


@gluon.jit
def _token_rows(sorted_pairs, start, m0, count, top_k, SLICE: gl.constexpr):
    """The tile's 8 token rows in layout SLICE: (row in the expert's sorted pairs, its pair, token, valid)."""
    t = m0 + gl.arange(0, 8, layout=SLICE)
    ok = t < count
    pair = gl.load(sorted_pairs + start + t, mask=ok, other=0)
    return start + t, pair, pair // top_k, ok


# Codes to bf16 by bit fields, two a 32-bit register (as Marlin does): code j of a word (bits 4j..4j+3) and code
# j + 4 (bits 16+4j..) land in the low and high half of register j, sign at bit 15 / 31, the 3 bits e1 e0 m at 6..8 /
# 22..24: a bf16 whose exponent field is e, that is the code's value x 2^-126 (e = 0, the code 0.5, a subnormal);
# one bf16 multiply by 2^126 makes it the code's value, exactly.
_UPCAST = gl.constexpr("""{
.reg .b32 w, t, u, q, k;
mov.b32 w, $8;
mov.b32 k, 0x7E807E80;
shl.b32 t, w, 12; shl.b32 u, w, 6; and.b32 t, t, 0x80008000; and.b32 u, u, 0x01C001C0; or.b32 q, t, u;
mul.rn.bf16x2 q, q, k; mov.b32 {$0, $4}, q;
shl.b32 t, w, 8; shl.b32 u, w, 2; and.b32 t, t, 0x80008000; and.b32 u, u, 0x01C001C0; or.b32 q, t, u;
mul.rn.bf16x2 q, q, k; mov.b32 {$1, $5}, q;
shl.b32 t, w, 4; shr.b32 u, w, 2; and.b32 t, t, 0x80008000; and.b32 u, u, 0x01C001C0; or.b32 q, t, u;
mul.rn.bf16x2 q, q, k; mov.b32 {$2, $6}, q;
shr.b32 u, w, 6; and.b32 t, w, 0x80008000; and.b32 u, u, 0x01C001C0; or.b32 q, t, u;
mul.rn.bf16x2 q, q, k; mov.b32 {$3, $7}, q;
}""")


@gluon.jit
def _weights(packed, a_offs, g: gl.constexpr):
    """Group g's 64 x 32 codes (packed: the tile's words of this K step) as the MMA's A operand, exact bf16 (no
    scale). Lane (r, c)'s slot 8j + 2c + h holds code 8c + j + 4h of its rows."""
    words = gl.load(packed + a_offs + g * 4)
    c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
        _UPCAST, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    lo = gl.join(gl.join(c0, c4), gl.join(c1, c5))  # [.., h, j & 1] of j = 0, 1
    hi = gl.join(gl.join(c2, c6), gl.join(c3, c7))  # of j = 2, 3
    codes = gl.permute(gl.join(lo, hi), [0, 1, 2, 6, 5, 3, 4])  # [w, b, r, j >> 1, j & 1, c, h]
    return gl.convert_layout(gl.reshape(codes, [64, 32]), _A)


@gluon.jit
def _activations(src, b_offs, ok, g: gl.constexpr):
    """Group g's activations of the tile's tokens (zero past the expert's rows) as the MMA's B operand (src: this
    K step's first)."""
    raw = gl.load(src + b_offs + g * 32, mask=ok[:, None, None], other=0.0)
    slots = gl.reshape(gl.permute(gl.reshape(raw, [8, 4, 2, 4]), [3, 1, 2, 0]), [32, 8])  # slot 8j + 2c + h: 8c + j + 4h
    return gl.convert_layout(slots, _B)


@gluon.jit
def _scaled(acc, a, b, scales, s_offs, g: gl.constexpr):
    """acc + (a b) · 2^(s-127) by row, s the rows' E8M0 bytes of group g of this K step (255: NaN)."""
    part = mma_v2(a, b, gl.zeros([64, 8], gl.float32, layout=_MMA))
    s = gl.load(scales + s_offs + g).to(gl.int32)
    half = s >> 1
    lo = ((half + 64) << 23).to(gl.float32, bitcast=True)  # 2^(half - 63)
    hi = ((s - half + 63) << 23).to(gl.float32, bitcast=True)  # 2^(s - half - 64)
    return part * (gl.where(s == 255, float("nan"), lo) * hi)[:, None] + acc


@gluon.jit
def _tile(active_experts, expert_starts, expert_counts, stride_pn, stride_sn):
    """A program's expert (id, first sorted pair, row count), its 64 rows from n0, and the offsets of their
    weights (`_a_offsets`) and scales."""
    e = gl.load(active_experts + gl.program_id(0)).to(gl.int64)
    n0 = gl.program_id(1) * 64
    rows = n0 + gl.arange(0, 64, layout=_ROW)
    return (e, gl.load(expert_starts + e), gl.load(expert_counts + e), n0, rows, _a_offsets(stride_pn),
            rows.to(gl.int64) * stride_sn)


@gluon.jit
def _tanh(x):
    return 2.0 / (1.0 + gl.exp(-2.0 * x)) - 1.0


@gluon.jit
def mma_up_kernel(x, w1p, w1s, w3p, w3s, h, sorted_pairs, expert_starts, expert_counts, active_experts, num_active,
                  top_k, D, beta, linear_beta, stride_x, stride_pe, stride_pn, stride_se, stride_sn, stride_h,
                  ACT: gl.constexpr, G: gl.constexpr):
    """Program (active slot, 64 rows of I): both projections of the rows, the GLU, h in bf16."""
    if gl.program_id(0) >= gl.load(num_active):
        return
    e, start, count, n0, rows, a_offs, s_offs = _tile(active_experts, expert_starts, expert_counts, stride_pn, stride_sn)
    for m0 in range(0, count, 8):
        _, _, tok, ok = _token_rows(sorted_pairs, start, m0, count, top_k, _B_TOKEN)
        b_offs = _b_offsets(tok.to(gl.int64) * stride_x)
        gate = gl.zeros([64, 8], gl.float32, layout=_MMA)
        up = gl.zeros([64, 8], gl.float32, layout=_MMA)
        # Scalar pointers to this K step's first group, moved a step at a time: the unrolled groups' loads
        # address them with immediate offsets.
        gate_w, up_w = w1p + e * stride_pe + n0 * stride_pn, w3p + e * stride_pe + n0 * stride_pn
        gate_s, up_s, xk = w1s + e * stride_se, w3s + e * stride_se, x
        for _ in range(0, D // 32, G):
            for g in gl.static_range(G):
                b = _activations(xk, b_offs, ok, g)
                gate = _scaled(gate, _weights(gate_w, a_offs, g), b, gate_s, s_offs, g)
                up = _scaled(up, _weights(up_w, a_offs, g), b, up_s, s_offs, g)
            gate_w, up_w, gate_s, up_s, xk = gate_w + G * 4, up_w + G * 4, gate_s + G, up_s + G, xk + G * 32
        if ACT == 1:  # SiTU-GLU
            act = beta * _tanh(gate / beta) / (1.0 + gl.exp(-gate)) * (linear_beta * _tanh(up / linear_beta))
        else:  # SwiGLU
            act = gate / (1.0 + gl.exp(-gate)) * up
        dst_row, _, _, dst_ok = _token_rows(sorted_pairs, start, m0, count, top_k, _TOKEN)
        dst = h + dst_row.to(gl.int64)[None, :] * stride_h + rows[:, None]
        gl.store(dst, act.to(gl.bfloat16), mask=dst_ok[None, :])


@gluon.jit
def mma_down_kernel(h, w2p, w2s, out, topk_weights, sorted_pairs, expert_starts, expert_counts, active_experts,
                    num_active, top_k, I, stride_h, stride_pe, stride_pn, stride_se, stride_sn, stride_out,
                    G: gl.constexpr):
    """Program (active slot, 64 rows of D): h W2^T of the expert's rows, weighted, added into out."""
    if gl.program_id(0) >= gl.load(num_active):
        return
    e, start, count, n0, rows, a_offs, s_offs = _tile(active_experts, expert_starts, expert_counts, stride_pn, stride_sn)
    for m0 in range(0, count, 8):
        src_row, _, _, ok = _token_rows(sorted_pairs, start, m0, count, top_k, _B_TOKEN)
        b_offs = _b_offsets(src_row.to(gl.int64) * stride_h)
        acc = gl.zeros([64, 8], gl.float32, layout=_MMA)
        w, ws, hk = w2p + e * stride_pe + n0 * stride_pn, w2s + e * stride_se, h  # as in the up kernel
        for _ in range(0, I // 32, G):
            for g in gl.static_range(G):
                acc = _scaled(acc, _weights(w, a_offs, g), _activations(hk, b_offs, ok, g), ws, s_offs, g)
            w, ws, hk = w + G * 4, ws + G, hk + G * 32
        _, pair, tok, dst_ok = _token_rows(sorted_pairs, start, m0, count, top_k, _TOKEN)
        acc = acc * gl.load(topk_weights + pair, mask=dst_ok, other=0.0)[None, :]
        gl.atomic_add(out + tok.to(gl.int64)[None, :] * stride_out + rows[:, None], acc, mask=dst_ok[None, :])


def groups_a_step(groups: int) -> int:
    """MX groups a K-loop step unrolls (loads in flight): the largest of 8, 4, 2, 1 that divides `groups`."""
    return next(g for g in (8, 4, 2, 1) if groups % g == 0)


def supports(x: Tensor, w1: MXFP4Tensor, w2: MXFP4Tensor) -> bool:
    """Whole 64-row tiles of I and D (the kernels have no row masks), and the loads' alignment: 4-byte packed rows,
    16-byte activation rows."""
    I, D = w1.shape[1], w1.shape[2]
    return (I % ROWS == 0 and D % ROWS == 0 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and all(t.stride(-2) % 4 == 0 and t.data_ptr() % 4 == 0 for t in (w1.packed, w2.packed)))


def experts(x: Tensor, w1: MXFP4Tensor, w3: MXFP4Tensor, w2: MXFP4Tensor, h: Tensor, out: Tensor,
            topk_weights: Tensor, routing: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], top_k: int,
            act: tuple[int, float, float]) -> None:
    """Launch the up and down kernels (the caller, triton_moe.fused_experts, has routed and allocated): x [T, D]
    bf16, MXFP4 w1/w3 [E, I, D] and w2 [E, D, I], h bf16 [T*k, I], out fp32 [T, D] zeroed, topk_weights fp32
    [T*k], routing as triton_moe.route returns it, act = (ACT, beta, linear_beta)."""
    pairs, starts, counts, active, num_active = routing
    kind, beta, linear_beta = act
    E, I, D = w1.shape
    p1, p3 = _words(w1), _words(w3)
    s1, s3 = w1.scales, w3.scales
    mma_up_kernel[(min(E, pairs.numel()), I // ROWS)](
        x, p1, s1, p3, s3, h, pairs, starts, counts, active, num_active, top_k, D, beta, linear_beta,
        x.stride(0), p1.stride(0), p1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
        ACT=kind, G=groups_a_step(D // 32), num_warps=NUM_WARPS)
    down_projection(h, w2, out, topk_weights, routing, top_k)


def down_projection(h: Tensor, w2: MXFP4Tensor, out: Tensor, topk_weights: Tensor,
                    routing: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], top_k: int) -> None:
    """out[tok] += topk_weight[pair] · h[pair] W2[e]^T (the down kernel alone; `experts` runs it after the up)."""
    pairs, starts, counts, active, num_active = routing
    E, D, I = w2.shape
    p2, s2 = _words(w2), w2.scales
    mma_down_kernel[(min(E, pairs.numel()), D // ROWS)](
        h, p2, s2, out, topk_weights, pairs, starts, counts, active, num_active, top_k, I,
        h.stride(0), p2.stride(0), p2.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
        G=groups_a_step(I // 32), num_warps=NUM_WARPS)


def _words(w: MXFP4Tensor) -> Tensor:
    """The packed bank as 32-bit words, 8 codes each (the kernels' strides are then in words)."""
    return w.packed.view(torch.int32)
