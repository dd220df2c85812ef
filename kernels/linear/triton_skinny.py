"""x @ weight^T for decode-sized x (T <= 16 rows) on the tensor cores, streaming the weight once.

With a handful of rows the GEMM is a weight stream: N·K weights read once for 2·T·N·K flops. So the
weight rows take the MMA's M side (swap AB) and the rows of x its N side, padded to BLOCK_T (8 or 16):

    program (n, s)  weight rows [n·BLOCK_N, (n+1)·BLOCK_N), K blocks [s·blocks_per_split, (s+1)·blocks_per_split)
    K loop          acc[BLOCK_N, BLOCK_T] += w[BLOCK_N, BLOCK_K] · x^T[BLOCK_K, BLOCK_T] in fp32, software
                    pipelined over num_stages, so each SM keeps several weight tiles in flight
    padding         weight rows past N and x rows past T are clamped to the last valid one (no masks on
                    the stream); their outputs are never stored

Split-K, for few weight rows over a long K (MLA's stacked q_a|kv_a|g, 3648 x 7168: 57 tiles of 64 rows for
132 SMs, split in 2 on the H200; the router's logits are fp32 and stay on cuBLAS, see __init__.py):
each split writes its fp32 partial tile to a workspace and takes a ticket from the tile's counter; the
split that draws the last ticket sums the partials in split order (the same sum whichever finishes
last), stores the tile and puts the counter back to 0 for the next call. No memset, no second launch,
no host sync, so the call is CUDA-graph capturable. The counters (one int32 a tile, zeroed once when
allocated) live as long as the process; launches that share them must not overlap (one stream).

Tiles are chosen per (N, K, BLOCK_T, dtypes, device) by timing every candidate the first time a shape
runs, which must be eager: the engine warms each decode bucket up before it captures it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
import triton.testing
from torch import Tensor
from triton.runtime.errors import OutOfResources

from .._backend import device_of
from . import MAX_TRITON_ROWS


@triton.jit(do_not_specialize=["T", "N", "blocks_per_split"])  # no binary of its own per row count or N
def _skinny_kernel(x, w, out, partials, tickets, T, N, K, stride_x, blocks_per_split,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                   SPLIT: tl.constexpr, EVEN_K: tl.constexpr):
    """x [T, K] (unit inner stride), w [N, K] contiguous, out [T, N] contiguous; partials fp32
    [splits, tiles, BLOCK_N, BLOCK_T] and tickets int32 [>= tiles] only read when SPLIT."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w + (tl.minimum(offs_n, N - 1).to(tl.int64) * K)[:, None] + offs_k[None, :]
    x_ptrs = x + (tl.minimum(offs_t, T - 1).to(tl.int64) * stride_x)[None, :] + offs_k[:, None]
    k_first = split * blocks_per_split * BLOCK_K
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for i in range(0, blocks_per_split):  # every split streams the same number of K blocks
        k = k_first + i * BLOCK_K
        if EVEN_K:
            w_tile = tl.load(w_ptrs + k)
            x_tile = tl.load(x_ptrs + k)
        else:
            k_ok = k + offs_k < K
            w_tile = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0.0)
            x_tile = tl.load(x_ptrs + k, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(w_tile, x_tile, acc)
    store_ok = (offs_n < N)[:, None] & (offs_t < T)[None, :]
    if SPLIT:
        splits = tl.num_programs(1)
        tile_offs = (tl.arange(0, BLOCK_N) * BLOCK_T)[:, None] + offs_t[None, :]
        tile_partials = partials + tile.to(tl.int64) * (BLOCK_N * BLOCK_T) + tile_offs
        split_stride = tl.num_programs(0).to(tl.int64) * (BLOCK_N * BLOCK_T)
        tl.store(tile_partials + split * split_stride, acc)
        tl.debug_barrier()  # every thread's share of the partial is written before the ticket is taken
        ticket = tl.atomic_add(tickets + tile, 1, sem="acq_rel", scope="gpu")
        last = ticket == splits - 1
        if last:
            acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
            for s in range(0, splits):  # L2 reads (.cg): the other splits' partials are not in this SM's L1
                acc += tl.load(tile_partials + s * split_stride, cache_modifier=".cg")
            tl.store(tickets + tile, 0)
        store_ok = store_ok & last
    tl.store(out + offs_t[None, :] * N + offs_n[:, None], acc.to(out.dtype.element_ty), mask=store_ok)


@dataclass(frozen=True)
class Tiles:
    """One launch configuration: BLOCK_N weight rows a program, BLOCK_K a step, `splits` K shares."""

    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"n{self.block_n} k{self.block_k} split{self.splits} w{self.num_warps} s{self.num_stages}"


# (BLOCK_N, BLOCK_K, num_warps, num_stages): 48-160 KB of shared memory, so 1-4 programs an SM with
# 48-128 KB of weights in flight each. BLOCK_N 32 uses mma.sync, 64 wgmma on sm_90. Each won some K3 shape on
# an H200 (benchmarks/results/h200-2026-12-01/gpu_linear.log; 32 x 128 only where linear keeps cuBLAS: the
# 1536 x 128 f_b_proj, the router's fp32 logits); 128 x 128 in 4 stages won none.
_BASES = ((32, 256, 4, 4), (64, 256, 4, 4), (64, 128, 4, 6), (32, 128, 4, 6))
_MAX_PROGRAMS_PER_SM = 4  # split no further than this many programs an SM
_MIN_BLOCKS_PER_SPLIT = 2  # each split streams at least two K blocks


def candidates(N: int, K: int, sm_count: int) -> list[Tiles]:
    """The configurations timed for an [N, K] weight: every base unsplit, and split into each count of
    equal K shares of at least _MIN_BLOCKS_PER_SPLIT blocks that keeps the programs under
    _MAX_PROGRAMS_PER_SM an SM."""
    found = []
    for block_n, block_k, num_warps, num_stages in _BASES:
        tiles, blocks = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
        for splits in range(1, blocks + 1):
            if splits == 1 or (blocks % splits == 0 and blocks // splits >= _MIN_BLOCKS_PER_SPLIT
                               and tiles * splits <= _MAX_PROGRAMS_PER_SM * sm_count):
                found.append(Tiles(block_n, block_k, splits, num_warps, num_stages))
    return found


_tickets: dict[tuple[torch.device, int], Tensor] = {}  # (device, tiles) -> int32 [tiles], all 0 between launches


def _tickets_for(device: torch.device, tiles: int) -> Tensor:
    key = (device, tiles)
    if key not in _tickets:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"linear: split-K counters for {tiles} tiles must be allocated before CUDA graph "
                               "capture; run the shape once eagerly first")
        _tickets[key] = torch.zeros(tiles, dtype=torch.int32, device=device)
    return _tickets[key]


def launch(x: Tensor, weight: Tensor, out: Tensor, tiles: Tiles) -> Tensor:
    """out [T, N] = x [T, K] @ weight [N, K]^T with the given tiles (x rows with a unit inner stride)."""
    T, K = x.shape
    N = weight.shape[0]
    blocks = triton.cdiv(K, tiles.block_k)
    if not 1 <= T <= MAX_TRITON_ROWS or blocks % tiles.splits:
        raise ValueError(f"x must have 1..{MAX_TRITON_ROWS} rows and the {blocks} K blocks split evenly, got "
                         f"{T} rows and {tiles.splits} splits")
    block_t = _block_t(T)
    num_tiles = triton.cdiv(N, tiles.block_n)
    if tiles.splits > 1:
        partials = torch.empty(tiles.splits * num_tiles * tiles.block_n * block_t, dtype=torch.float32,
                               device=x.device)
        tickets = _tickets_for(x.device, num_tiles)
    else:
        partials = tickets = out  # never read
    with device_of(x):
        _skinny_kernel[(num_tiles, tiles.splits)](
            x, weight, out, partials, tickets, T, N, K, x.stride(0), blocks // tiles.splits,
            BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, BLOCK_T=block_t, SPLIT=tiles.splits > 1,
            EVEN_K=K % tiles.block_k == 0, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    return out


def _block_t(rows: int) -> int:
    """The rows of x a tile holds: 8 up to 8 rows (half the padding), else MAX_TRITON_ROWS."""
    return 8 if rows <= 8 else MAX_TRITON_ROWS


_chosen: dict[tuple, Tiles] = {}  # (N, K, BLOCK_T, x dtype, out dtype, device) -> the fastest tiles measured


def linear(x: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
    """x [T, K] @ weight [N, K]^T -> [T, N] in out_dtype, with the tiles timed fastest for this shape."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype, device=x.device)
    return launch(x, weight, out, tiles_for(x, weight, out))


def tiles_for(x: Tensor, weight: Tensor, out: Tensor) -> Tiles:
    """The tiles `linear` runs for this shape: timed on these tensors the first time (eagerly), then kept."""
    key = (*weight.shape, _block_t(x.shape[0]), x.dtype, out.dtype, x.device)
    if key not in _chosen:
        _chosen[key] = _fastest(x, weight, out)
    return _chosen[key]


def _fastest(x: Tensor, weight: Tensor, out: Tensor) -> Tiles:
    """Times every candidate on these tensors (eagerly: it synchronizes); shared memory too small for a
    candidate on this device rules it out."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"linear: weight {tuple(weight.shape)} with {x.shape[0]} rows was not run before CUDA "
                           "graph capture; its tiles are timed eagerly, so run the shape once first")
    times = {}
    with torch.cuda.device(x.device):  # do_bench's events and cache flush on x's device
        for tiles in candidates(*weight.shape, torch.cuda.get_device_properties(x.device).multi_processor_count):
            try:
                times[tiles] = triton.testing.do_bench(lambda tiles=tiles: launch(x, weight, out, tiles),
                                                       warmup=5, rep=25)
            except OutOfResources:
                continue
    return min(times, key=times.get)
