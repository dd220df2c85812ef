"""linear on the device: decode-sized x (1..16 rows) against K3's per-rank weights at TP8 runs the Triton
skinny GEMM and gives the fp32 sums of the exact products (cuBLAS with fp32 output: naive.py), rounded
once to the output dtype; split-K included (the router's 896 rows), in a CUDA graph too, where a new
unsplit shape's first call may be the captured one. The tile rule's picks launch on this device; the fallbacks
for smaller shared memory run and match too, and a tiling the device cannot hold falls to the next.
fp32 outputs of bf16 inputs (the router's logits) run it too; larger batches, small weights and fp32 inputs stay
on cuBLAS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3serve.kernels import linear as linear_op
from k3serve.kernels.linear import MIN_TRITON_WEIGHT, linear, naive, tile_rule
from k3serve.kernels.linear.tile_rule import Tiles

from _close import assert_close
from _linear_cases import k3_rank_weights

pytestmark = pytest.mark.gpu

K3_RANK_WEIGHTS = k3_rank_weights()
STREAMED = [(name, N, K) for name, N, K in K3_RANK_WEIGHTS if N * K >= MIN_TRITON_WEIGHT]
ROUTER = next(w for w in K3_RANK_WEIGHTS if w[0] == "MoE router")
WITH_ADD = [w for w in STREAMED if w[0] in ("MoE latent up", "MoE router")]  # unsplit and split-K on an H200


def _weight(N: int, K: int) -> torch.Tensor:
    return (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()


def _check(case: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """Against the fp32 sums of the exact products: fp32 out within fp32 summation error (scaled to the
    output), bf16 out within that plus its one rounding (2^-8 relative)."""
    ref = naive.linear(x, w, torch.float32)
    atol = 1e-5 * ref.abs().max().item()
    rtol = 2**-8 if out.dtype == torch.bfloat16 else 1e-5
    assert_close(case, ref, out.float(), atol, rtol)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16 out", "fp32 out"])
@pytest.mark.parametrize("T", [1, 2, 4, 8, 16], ids=lambda T: f"T{T}")
@pytest.mark.parametrize(("name", "N", "K"), STREAMED, ids=[name for name, _, _ in STREAMED])
def test_k3_rank_weights_run_triton_and_match(name: str, N: int, K: int, T: int, out_dtype: torch.dtype) -> None:
    w = _weight(N, K)
    x = torch.randn(T, K, device="cuda").bfloat16()
    linear_op.last_backend.clear()
    out = linear(x, w, out_dtype)
    assert linear_op.last_backend["linear"] == "triton" and out.shape == (T, N) and out.dtype == out_dtype
    _check(f"{name} T{T}", x, w, out)
    assert torch.equal(linear(x, w, out_dtype), out), "a second call differs (split-K is deterministic)"


@pytest.mark.parametrize("T", [1, 16], ids=lambda T: f"T{T}")
@pytest.mark.parametrize(("name", "N", "K"), WITH_ADD, ids=[name for name, _, _ in WITH_ADD])
def test_add_joins_the_sums_before_the_rounding(name: str, N: int, K: int, T: int) -> None:
    """The shared experts' fp32 sum added to the latent up-projection in the kernel (the last split adds it)."""
    w = _weight(N, K)
    x = torch.randn(T, K, device="cuda").bfloat16()
    add = torch.randn(T, N, device="cuda")
    out = linear(x, w, add=add)
    assert linear_op.last_backend["linear"] == "triton" and out.dtype == torch.bfloat16
    assert_close(f"{name} T{T} + add", naive.linear(x, w, torch.float32) + add, out.float(),
                 1e-5 * add.abs().max().item(), 2**-8)
    assert torch.equal(linear(x, w, torch.float32, add), linear(x, w, torch.float32) + add)


def test_leading_dims_and_strided_rows() -> None:
    """x [2, 3, K] and x a column slice of a wider activation (row stride != K) run the kernel in place."""
    w = _weight(3648, 7168)
    x3 = torch.randn(2, 3, 7168, device="cuda").bfloat16()
    out = linear(x3, w)
    assert linear_op.last_backend["linear"] == "triton" and out.shape == (2, 3, 3648)
    _check("leading dims", x3.reshape(6, 7168), w, out.reshape(6, 3648))
    sliced = torch.randn(5, 9000, device="cuda").bfloat16()[:, 100:7268]
    out = linear(sliced, w)
    assert linear_op.last_backend["linear"] == "triton"
    _check("strided rows", sliced, w, out)


@pytest.mark.parametrize("T", [1, 16], ids=lambda T: f"T{T}")
def test_every_split_k_candidate_matches(T: int) -> None:
    """The split-K path in every split the benchmark times: each split candidate of the router-sized weight (the
    partials, the acq_rel tickets, the last split's L2 sum) gives the reference, and again on a second call (its
    tickets back at 0)."""
    from k3serve.kernels.linear import triton_skinny

    _, N, K = ROUTER
    w, x = _weight(N, K), torch.randn(T, K, device="cuda").bfloat16()
    sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
    split = [tiles for tiles in tile_rule.candidates(N, K, sm_count) if tiles.splits > 1]
    assert split, "no split-K candidate for the router-sized weight"
    for tiles in split:
        out = triton_skinny.launch(x, w, torch.empty(T, N, dtype=torch.bfloat16, device="cuda"), tiles)
        _check(f"{tiles} T{T}", x, w, out)
        assert torch.equal(triton_skinny.launch(x, w, torch.empty_like(out), tiles), out), f"{tiles}: second call"


@pytest.mark.parametrize(("name", "N", "K"), [STREAMED[0], ROUTER], ids=["KDA stacked", "router"])
def test_cuda_graph_replays_with_new_inputs(name: str, N: int, K: int) -> None:
    """Captured after one eager call (which allocates the router's split-K tickets), the graph replays the kernel
    on whatever x holds, the split-K tickets reset by each replay."""
    w = _weight(N, K)
    x = torch.randn(4, K, device="cuda").bfloat16()
    linear(x, w)  # eager: allocates the tickets
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    _capture_and_replay(name, x, w)


def _capture_and_replay(case: str, x: torch.Tensor, w: torch.Tensor) -> None:
    """linear(x, w) captured in a CUDA graph and replayed on new values of x, each checked."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w)
    assert linear_op.last_backend["linear"] == "triton"
    for step in range(3):
        x.copy_(torch.randn(x.shape, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        _check(f"{case} replay {step}", x, w, out)


def test_a_new_unsplit_shape_s_first_call_can_be_captured() -> None:
    """Nothing is timed, so a weight shape never run before is first called inside the capture, once an eager call
    of another shape has loaded the same binary (same tiles, BLOCK_T and dtypes: Triton cannot load a module while
    a stream captures); the graph replays it on new inputs."""
    from k3serve.kernels.linear import triton_skinny

    K = 7168
    loaded = _weight(8448, K)  # n64 k128 unsplit, like the shape below
    x = torch.randn(3, K, device="cuda").bfloat16()
    linear(x, loaded)
    w = _weight(6080, K)  # 95 tiles of 64 rows: over half of an H100/H200's SMs busy, unsplit
    assert triton_skinny.tile_order_for(x, w)[0] == triton_skinny.tile_order_for(x, loaded)[0]
    _capture_and_replay("first call captured", x, w)


@pytest.mark.parametrize("T", [1, 16], ids=lambda T: f"T{T}")
def test_the_rule_s_picks_launch_on_this_device(T: int) -> None:
    """At every streamed K3 weight the first tiling of the rule's order fits this device (no fallback taken)."""
    from k3serve.kernels.linear import triton_skinny

    for name, N, K in STREAMED:
        w, x = _weight(N, K), torch.randn(T, K, device="cuda").bfloat16()
        order = triton_skinny.tile_order_for(x, w)
        out = torch.empty(T, N, dtype=torch.bfloat16, device="cuda")
        assert triton_skinny.launch_first_fitting(x, w, out, order) == order[0], f"{name} T{T}: {order[0]} did not fit"
        _check(f"{name} T{T} {order[0]}", x, w, out)


@pytest.mark.parametrize("smem_kb", [163, 99, 64, 48, 8], ids=lambda kb: f"{kb} KB")
@pytest.mark.parametrize("T", [1, 16], ids=lambda T: f"T{T}")
def test_fallbacks_for_smaller_shared_memory_run_and_match(T: int, smem_kb: int) -> None:
    """What devices with less shared memory would run (A100, sm_86/89, sm_75, any), run here on the router-sized
    weight (split-K kept) and on the dense MLP's (unsplit)."""
    from k3serve.kernels.linear import triton_skinny

    sm_count = torch.cuda.get_device_properties("cuda").multi_processor_count
    for N, K in (ROUTER[1:], (8448, 7168)):
        w, x = _weight(N, K), torch.randn(T, K, device="cuda").bfloat16()
        tiles = tile_rule.tile_order(N, K, tile_rule.block_t(T), sm_count, smem_kb * 1024)[0]
        out = triton_skinny.launch(x, w, torch.empty(T, N, dtype=torch.bfloat16, device="cuda"), tiles)
        _check(f"{N}x{K} T{T} {tiles}", x, w, out)


def test_a_tiling_the_device_cannot_hold_falls_to_the_next() -> None:
    """64 x 256 in 8 stages needs over 256 KB of shared memory: Triton refuses it before launching, the next tiling
    runs; an order of only such tilings is a clear error, not OutOfResources."""
    from k3serve.kernels.linear import triton_skinny

    too_big = Tiles(64, 256, 1, 4, 8)
    N, K = 8448, 7168
    w, x = _weight(N, K), torch.randn(16, K, device="cuda").bfloat16()
    fits = triton_skinny.tile_order_for(x, w)[0]
    out = torch.full((16, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert triton_skinny.launch_first_fitting(x, w, out, [too_big, fits]) == fits
    _check("after a refused tiling", x, w, out)
    with pytest.raises(RuntimeError, match="none of the tilings"):
        triton_skinny.launch_first_fitting(x, w, out, [too_big])


@pytest.mark.parametrize(
    ("rows", "N", "K", "dtype"),
    [(17, 6284, 7168, torch.bfloat16), (4, 1536, 128, torch.bfloat16), (4, 896, 7168, torch.float32)],
    ids=["17 rows", "small weight (KDA f_b_proj)", "fp32"],
)
def test_outside_the_skinny_cases_cublas_runs(rows: int, N: int, K: int, dtype: torch.dtype) -> None:
    w = torch.randn(N, K, device="cuda").to(dtype)
    x = torch.randn(rows, K, device="cuda").to(dtype)
    out = linear(x, w)
    assert linear_op.last_backend["linear"] == "naive"
    assert torch.equal(out, F.linear(x, w))


def test_non_contiguous_weight_runs_cublas() -> None:
    w = _weight(7168, 3648).t()
    x = torch.randn(2, 7168, device="cuda").bfloat16()
    assert torch.equal(linear(x, w), F.linear(x, w)) and linear_op.last_backend["linear"] == "naive"
