"""The CUDA path's MLA kernels, run by the Triton interpreter on CPU tensors, match the torch reference
(naive.py): the split-KV decode over the paged latent cache and its LSE merge (triton_decode.py), and the
cache write that skips slot -1 (triton_cache.py). test_mla_gpu.py checks the decode in bf16 at K3 shapes
on the device; here it reads an fp16 cache, the kernel's other dtype, because the interpreter cannot
multiply bf16 (see _triton_interpret)."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

L, R, BLOCK = 64, 16, 16  # the smallest power-of-2 sizes the kernel takes
SCALE = 80**-0.5

pytestmark = needs_triton


def _decode_matches_reference() -> None:
    """Several sequences at once (an empty one, one token, a block exactly full, partly filled last blocks),
    in one split, the default split count and 3 splits (the partial + merge path, where short sequences
    leave splits empty), and 40 heads: two head groups of 32, the second one partly masked."""
    import torch

    from k3serve.kernels.mla import naive, triton_decode

    from _close import assert_rel_rms
    from _mla_cases import paged_decode_case

    for seq_lens, heads, num_splits in [([40, 16, 1, 0, 33, 100], 4, 1), ([40, 16, 1, 0, 33, 100], 4, None),
                                        ([40, 16, 1, 0, 33, 100], 4, 3), ([70, 5], 40, 2)]:
        case = f"lens {seq_lens} H{heads} splits {num_splits}"
        q_latent, q_pe, kv, tables, lens = paged_decode_case(seq_lens, heads, L, R, BLOCK, torch.float16, "cpu")
        o, lse = triton_decode.mla_decode_paged(q_latent, q_pe, kv, tables, lens, SCALE, max(seq_lens), num_splits)
        ref_o, ref_lse = naive.mla_decode_paged(q_latent, q_pe, kv, tables, lens, SCALE, L)
        assert o.dtype == torch.float16 and lse.dtype == torch.float32, case
        assert_rel_rms(f"o_latent, {case}", ref_o, o, 2e-3)  # fp16 probabilities into the p·c product
        empty = lens == 0
        assert torch.equal(torch.isinf(lse), empty[:, None].expand_as(lse)), case
        assert (o[empty] == 0).all(), case
        assert (lse[~empty] - ref_lse[~empty]).abs().max() < 1e-4, case


def _decode_takes_fp32_strided_queries_and_int64_tables() -> None:
    import torch

    from _mla_cases import check_decode_takes_layer_queries

    check_decode_takes_layer_queries(L, R, BLOCK, SCALE, torch.float16, "cpu", 2e-3, 1e-4)


def _merge_matches_reference() -> None:
    """bf16 parts (loaded and stored only, which the interpreter does exactly); 20 parts, two chunks of 16;
    80 columns, two column programs, the second partly masked; parts with lse -inf and NaN outputs add
    nothing; a head whose parts are all empty gives 0 and -inf."""
    import torch

    from k3serve.kernels.mla import naive, triton_decode

    from _close import assert_close

    outputs = torch.randn(20, 3, 4, 80).bfloat16()
    lses = torch.randn(20, 3, 4) * 3
    lses[0, 0], outputs[0, 0] = float("-inf"), float("nan")
    lses[:, 1, 2], outputs[:, 1, 2] = float("-inf"), float("nan")
    o, lse = triton_decode.merge_attn_states(outputs, lses)
    ref_o, ref_lse = naive.merge_attn_states(outputs, lses)
    assert o.dtype == torch.bfloat16
    assert_close("o", ref_o, o, 8e-3, 8e-3)  # one bf16 rounding apart
    assert_close("lse", ref_lse, lse, 1e-5, 1e-5)
    assert (o[1, 2] == 0).all() and lse[1, 2] == float("-inf")


def _cache_write_matches_reference() -> None:
    """Rows land bit-exactly at their slots (shuffled, across blocks), rows of slot -1 write nothing and
    nothing else changes (the NaN poison stays bit-identical, also in a guard block in front of the cache,
    where a row of slot -1 written as block -1 would land): K3's 576-wide rows and 1100-wide ones (two
    column programs, the second masked), bf16 and fp32, read where they are as the columns of wider rows
    (MLA's latent is a column slice of the fused projection of x)."""
    import torch

    from k3serve.kernels.mla import naive, triton_cache

    for dtype in (torch.bfloat16, torch.float32):
        for width in (576, 1100):
            guarded = torch.full((1 + 6, BLOCK, width), float("nan"), dtype=dtype)
            slots = torch.randperm(6 * BLOCK)[:21]
            slots[[0, 7, 20]] = -1
            latent = torch.randn(21, 40 + width).to(dtype)[:, 40:]
            ref = guarded.clone()
            naive.write_kv_cache(ref[1:], slots, latent)
            triton_cache.write_kv_cache(guarded[1:], slots, latent)
            assert torch.equal(guarded.view(torch.uint8), ref.view(torch.uint8)), f"{dtype} width {width}"
            triton_cache.write_kv_cache(guarded[1:], torch.full((4,), -1), latent[:4])
            assert torch.equal(guarded.view(torch.uint8), ref.view(torch.uint8)), f"{dtype} width {width}, all -1"


def test_decode_matches_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_decode_matches_reference")


def test_decode_takes_fp32_strided_queries_and_int64_tables_under_interpreter() -> None:
    run_in_interpreter(__file__, "_decode_takes_fp32_strided_queries_and_int64_tables")


def test_merge_matches_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_merge_matches_reference")


def test_cache_write_matches_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_cache_write_matches_reference")
