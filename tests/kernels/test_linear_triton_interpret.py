"""The skinny-GEMM kernel (triton_skinny.py) run by the Triton interpreter on CPU tensors: every tiling the
tuner may pick gives x @ weight^T, split-K included, and leaves its ticket counters at 0 for the next
call. The interpreter cannot multiply bf16 in tl.dot (see _triton_interpret.py), so the inputs are fp16;
bf16 outputs are only a cast of the same fp32 sums (which the interpreter truncates: within 2^-7, where
the GPU rounds to within 2^-8)."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _tilings_match_exact_products() -> None:
    """Awkward sizes: N = 100 leaves a partial tile of rows, K = 200 a partial K block (K = 256 none);
    T = 1, 5 (8-row tiles) and 11, 16 (16-row tiles); x a column slice of a wider tensor (row stride 300).
    Unsplit, and split in 2, 4 and one K block a split (7 or 8)."""
    import pytest
    import torch

    from k3serve.kernels.linear import triton_skinny
    from k3serve.kernels.linear.triton_skinny import Tiles

    from _close import assert_close

    for T, K in ((1, 200), (5, 256), (11, 200), (16, 256)):
        wide = torch.randn(T, 300).half()
        x, w = wide[:, 7 : 7 + K], torch.randn(100, K).half()
        exact = x.double() @ w.double().t()
        for tiles in (Tiles(32, 64, 1, 4, 2), Tiles(32, 64, 2, 4, 2), Tiles(64, 64, 4, 4, 3),
                      Tiles(64, 32, -(-K // 32), 4, 2)):
            for out_dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2**-11), (torch.bfloat16, 2**-7)):
                case = f"T{T} K{K} {tiles} -> {out_dtype}"
                out = triton_skinny.launch(x, w, torch.full((T, 100), float("nan"), dtype=out_dtype), tiles)
                assert_close(case, exact, out.double(), 1e-4, tol)
                again = triton_skinny.launch(x, w, torch.empty(T, 100, dtype=out_dtype), tiles)
                assert torch.equal(out, again), f"{case}: a second call differs"
    assert triton_skinny._tickets and all(not t.any() for t in triton_skinny._tickets.values()), "tickets left set"
    with pytest.raises(ValueError, match="split evenly"):
        triton_skinny.launch(x, w, torch.empty(16, 100), Tiles(32, 64, 3, 4, 2))
    with pytest.raises(ValueError, match="rows"):
        triton_skinny.launch(torch.randn(17, 64).half(), w[:, :64], torch.empty(17, 100), Tiles(32, 64, 1, 4, 2))


def test_tilings_match_exact_products_under_interpreter() -> None:
    run_in_interpreter(__file__, "_tilings_match_exact_products")


def test_candidates_split_k_into_equal_shares() -> None:
    """At K3's rank shapes on 132 SMs: every candidate splits K into equal shares of at least 2 blocks, the
    programs stay within 4 an SM, and the router (896 rows) can be split enough to fill the SMs. Plain Python:
    no kernel runs, so no interpreter process."""
    from k3serve.kernels.linear.triton_skinny import candidates

    for N, K in ((6284, 7168), (896, 7168), (7168, 1536), (20480, 7168), (7168, 768), (7168, 4224)):
        tiled = candidates(N, K, 132)
        assert len(set(tiled)) == len(tiled) and any(t.splits == 1 for t in tiled)
        for t in tiled:
            blocks = -(-K // t.block_k)
            if t.splits > 1:
                assert blocks % t.splits == 0 and blocks // t.splits >= 2, (N, K, t)
                assert -(-N // t.block_n) * t.splits <= 4 * 132, (N, K, t)
    assert max(-(-896 // t.block_n) * t.splits for t in candidates(896, 7168, 132)) >= 132
