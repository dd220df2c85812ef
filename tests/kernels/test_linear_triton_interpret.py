"""The skinny-GEMM kernel (triton_skinny.py) run by the Triton interpreter on CPU tensors: tilings of every
kind the tile rule and its fallbacks launch give x @ weight^T, split-K included, and leave their ticket
counters at 0 for the next call; the first tiling of the rule's order is the one that launches. The
interpreter cannot multiply bf16 in tl.dot (see _triton_interpret.py), so the inputs are fp16; bf16 outputs are
only a cast of the same fp32 sums (which the interpreter truncates: within 2^-7, where
the GPU rounds to within 2^-8)."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _tilings_match_exact_products() -> None:
    """Awkward sizes: N = 100 leaves a partial tile of rows, K = 200 a partial K block (K = 256 none);
    T = 1, 5 (8-row tiles) and 11, 16 (16-row tiles); x a column slice of a wider tensor (row stride 300).
    Unsplit (K blocks of 64 and of 256, the wide pick's), and split in 2, 4 and one K block a split (7 or 8); each
    also with an fp32 tensor added to the sums before the store."""
    import pytest
    import torch

    from k3serve.kernels.linear import triton_skinny
    from k3serve.kernels.linear.tile_rule import Tiles, block_t, tile_order

    from _close import assert_close

    for T, K in ((1, 200), (5, 256), (11, 200), (16, 256)):
        wide = torch.randn(T, 300).half()
        x, w = wide[:, 7 : 7 + K], torch.randn(100, K).half()
        exact = x.double() @ w.double().t()
        for tiles in (Tiles(32, 64, 1, 4, 2), Tiles(32, 64, 2, 4, 2), Tiles(64, 64, 4, 4, 3),
                      Tiles(64, 32, -(-K // 32), 4, 2), Tiles(64, 256, 1, 4, 4)):
            for out_dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2**-11), (torch.bfloat16, 2**-7)):
                case = f"T{T} K{K} {tiles} -> {out_dtype}"
                out = triton_skinny.launch(x, w, torch.full((T, 100), float("nan"), dtype=out_dtype), tiles)
                assert_close(case, exact, out.double(), 1e-4, tol)
                again = triton_skinny.launch(x, w, torch.empty(T, 100, dtype=out_dtype), tiles)
                assert torch.equal(out, again), f"{case}: a second call differs"
            add = torch.randn(T, 130)[:, 3:103]  # a residual, rows strided: joins the fp32 sums of the last split
            out = triton_skinny.launch(x, w, torch.empty(T, 100), tiles, add)
            assert_close(f"T{T} K{K} {tiles} + add", exact + add.double(), out.double(), 1e-4, 1e-5)
        order = tile_order(100, K, block_t(T), 132, 232448)  # an H200's: n64 k128 unsplit (K too short to split)
        out = torch.empty(T, 100, dtype=torch.float32)
        assert triton_skinny.launch_first_fitting(x, w, out, order) == order[0], "the rule's pick did not launch"
        assert_close(f"T{T} K{K} rule {order[0]}", exact, out.double(), 1e-4, 1e-5)
    assert triton_skinny._tickets and all(not t.any() for t in triton_skinny._tickets.values()), "tickets left set"
    with pytest.raises(ValueError, match="split evenly"):
        triton_skinny.launch(x, w, torch.empty(16, 100), Tiles(32, 64, 3, 4, 2))
    with pytest.raises(ValueError, match="rows"):
        triton_skinny.launch(torch.randn(17, 64).half(), w[:, :64], torch.empty(17, 100), Tiles(32, 64, 1, 4, 2))


def test_tilings_match_exact_products_under_interpreter() -> None:
    run_in_interpreter(__file__, "_tilings_match_exact_products")
