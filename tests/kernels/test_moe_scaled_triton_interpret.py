"""The Blackwell MXFP4 experts (`kernels/moe/triton_scaled.py`) run by the Triton interpreter on CPU tensors. The
interpreter of triton 3.6 has no `tl.dot_scaled`, so there the kernels' one product is `_mx_dot`'s plain Triton
(both operands decoded exactly to fp32 as dot_scaled's documentation defines them); everything else is the code the
GPU runs: the split of x and h into two MXFP8 terms, the addressing of the packed bank and its scales as the
checkpoint stores them, routing, the GLU, the weighting and the atomics. test_moe_scaled_compile.py checks that the
GPU build's product is the block-scaled MMA.

- `_mxfp8` gives exactly the bits of torch's float8_e4m3fn cast of naive.round_to_mxfp8's scaled values;
- the experts match the exact model of their math (naive.fused_experts on `round_to_mxfp8_pair` of x and of h) at
  every autotune config of each kernel: 1e-4 relative RMS (fp32 summation order and the GLU's tanh may move h's
  fp16 rounding, which the pair's 8 significant bits do not hold);
- and the unquantized reference to 1e-2, the Hopper pairs' GPU tolerance.
The activations are fp16 and fp32, not bf16: the interpreter casts fp32 to bf16 by truncation (_triton_interpret).
test_moe_scaled_gpu.py runs bf16."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton

EXACT_TOL = 1e-4  # vs the exact model of the kernels' math (measured 7e-7 on fp32, 3e-5 on fp16)
PAIR_TOL = 1e-2  # vs the unquantized reference, as the Hopper pairs on the GPU (measured 1.2e-3)


def _mxfp8_is_bit_exact() -> None:
    """Groups of every magnitude from 2^-140 to 2^120 (subnormal e4m3 elements and scales at both ends), an
    all-zero group, exact ties between e4m3 neighbours, signs, and the amax exactly at 448 · 2^k."""
    global triton_scaled  # the test kernel below resolves it among this module's globals
    import torch
    import triton
    import triton.language as tl

    from k3serve.kernels.moe import naive, triton_scaled

    @triton.jit
    def quantize(x, codes, scales, K: tl.constexpr):
        rows = tl.arange(0, 16)
        q, s = triton_scaled._mxfp8(tl.load(x + rows[:, None] * K + tl.arange(0, K)[None, :]))
        tl.store(codes + rows[:, None] * K + tl.arange(0, K)[None, :], q)
        tl.store(scales + rows[:, None] * (K // 32) + tl.arange(0, K // 32)[None, :], s)

    K = 256
    x = torch.randn(16, K) * torch.exp2(torch.randint(-140, 120, (16, K // 32)).float()).repeat_interleave(32, 1)
    x[0, :32] = 0.0
    ties = torch.tensor([1.0625, 1.1875, 0.0068359375, 0.0087890625, -1.0625, 3.25, 448.0, -240.0])  # e4m3 midpoints
    x[1, 32:64] = ties.repeat(4) * 2.0**-20
    x[2, 64:96] = torch.linspace(-448, 448, 32) * 2.0**30
    x[3] = x[3].clamp(-3e38, 3e38)
    codes, scales = torch.empty(16, K, dtype=torch.uint8), torch.empty(16, K // 32, dtype=torch.uint8)
    quantize[(1,)](x, codes, scales, K=K)
    want = naive.round_to_mxfp8(x)
    scale = torch.ldexp(torch.ones(16, K // 32), scales.int() - 127).repeat_interleave(32, 1)
    assert torch.equal(codes.view(torch.float8_e4m3fn).float() * scale, want)
    assert torch.equal(codes, (want / scale).to(torch.float8_e4m3fn).view(torch.uint8))  # -0 keeps its sign bit
    assert scales[0, 0] == 0


def _experts_match_the_model() -> None:
    """Rank 1 of 3 (experts 4..7 of 12): one local expert takes every token (20 rows, two token tiles of 16), another
    none, one token is wholly another rank's; D = 384: the up kernel's 3 K steps, the down kernel's 3 row tiles."""
    import torch

    from k3serve.kernels.moe import naive, silu_glu, triton_moe, triton_scaled

    from _close import assert_rel_rms
    from test_moe_gpu import SITU
    from test_moe_triton_interpret import rank_1_of_3_case

    E, I, D, T = 4, 128, 384, 20
    weights, topk_ids, topk_weights, x = rank_1_of_3_case(E, I, D, T)
    cases = ((SITU, torch.float16), (silu_glu, torch.float32))
    up_configs = triton_scaled.scaled_up_kernel.configs
    for i, down_config in enumerate(triton_scaled.scaled_down_kernel.configs):  # each config of each kernel once
        up_config = up_configs[i % len(up_configs)]
        activation, dtype = cases[i % 2]

        def model_act(gate, up):  # the kernels store h in x's dtype, then the down kernel splits it
            return naive.round_to_mxfp8_pair(activation(gate, up).to(dtype))

        xd = x.to(dtype)
        model = naive.fused_experts(naive.round_to_mxfp8_pair(xd), weights, topk_weights, topk_ids, model_act, E)
        ref = naive.fused_experts(xd, weights, topk_weights, topk_ids, activation, E)
        triton_scaled.scaled_up_kernel.configs, triton_scaled.scaled_down_kernel.configs = [up_config], [down_config]
        case = f"up {up_config}, down {down_config}, {dtype}, {getattr(activation, 'func', activation).__name__}"
        out = triton_moe.fused_experts(xd, weights, topk_weights, topk_ids, activation, E, path="scaled")
        assert triton_moe.last_path == "scaled" and out.dtype == torch.float32, case
        assert (out[T - 1] == 0).all(), case
        assert_rel_rms(f"out vs the exact model, {case}", model, out, EXACT_TOL)
        assert_rel_rms(f"out vs the reference, {case}", ref, out, PAIR_TOL)


def test_mxfp8_quantization_is_bit_exact_under_interpreter() -> None:
    run_in_interpreter(__file__, "_mxfp8_is_bit_exact")


def test_experts_match_the_model_of_their_math_under_interpreter() -> None:
    run_in_interpreter(__file__, "_experts_match_the_model")
