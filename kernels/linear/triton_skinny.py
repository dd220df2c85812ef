"""x @ weight^T for decode-sized x (T <= 16 rows) on the tensor cores, streaming the weight once: the weight rows
take the MMA's M side (swap AB), the rows of x its N side, padded to BLOCK_T (8 or 16); padding rows are clamped
to the last valid one and never stored. For few weight rows over a long K the K blocks are split, and the split
that draws a tile's last ticket sums the fp32 partials in split order (the same sum whichever finishes last) in
the same launch: no memset, no second launch, no host sync, so a call is CUDA-graph capturable once an eager
call of its shape loaded the binary and made its tile counters. Launches that share the counters must not
overlap (one stream). Tiles come from a fixed rule (tile_rule.py), the same on every rank and restart of one
device model. The program layout, split-K's tickets and what capture needs: docs/design/linear_skinny.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from .._backend import cuda_properties, device_of
from . import MAX_TRITON_ROWS
from .tile_rule import Tiles, block_t, tile_order


@triton.jit(do_not_specialize=["T", "N", "blocks_per_split"])  # no binary of its own per row count or N
def _skinny_kernel(x, w, out, add, partials, tickets, T, N, K, stride_x, stride_add, blocks_per_split,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                   SPLIT: tl.constexpr, EVEN_K: tl.constexpr, HAS_ADD: tl.constexpr):
    """x [T, K] (unit inner stride), w [N, K] contiguous, out [T, N] contiguous; add [T, N] (unit inner stride)
    only read when HAS_ADD, added to the fp32 sums before their one rounding; partials fp32
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
    if HAS_ADD:
        acc += tl.load(add + offs_t[None, :] * stride_add + offs_n[:, None], mask=store_ok, other=0.0).to(tl.float32)
    tl.store(out + offs_t[None, :] * N + offs_n[:, None], acc.to(out.dtype.element_ty), mask=store_ok)


_tickets: dict[tuple[torch.device, int], Tensor] = {}  # (device, tiles) -> int32 [tiles], all 0 between launches


def _tickets_for(device: torch.device, tiles: int) -> Tensor:
    key = (device, tiles)
    if key not in _tickets:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"linear: split-K counters for {tiles} tiles must be allocated before CUDA graph "
                               "capture; run the shape once eagerly first")
        _tickets[key] = torch.zeros(tiles, dtype=torch.int32, device=device)
    return _tickets[key]


def launch(x: Tensor, weight: Tensor, out: Tensor, tiles: Tiles, add: Tensor | None = None) -> Tensor:
    """out [T, N] = x [T, K] @ weight [N, K]^T (+ add [T, N]) with the given tiles (x and add rows with a unit
    inner stride)."""
    T, K = x.shape
    N = weight.shape[0]
    blocks = triton.cdiv(K, tiles.block_k)
    if not 1 <= T <= MAX_TRITON_ROWS or blocks % tiles.splits:
        raise ValueError(f"x must have 1..{MAX_TRITON_ROWS} rows and the {blocks} K blocks split evenly, got "
                         f"{T} rows and {tiles.splits} splits")
    num_tiles = triton.cdiv(N, tiles.block_n)
    if tiles.splits > 1:
        partials = torch.empty(tiles.splits * num_tiles * tiles.block_n * block_t(T), dtype=torch.float32,
                               device=x.device)
        tickets = _tickets_for(x.device, num_tiles)
    else:
        partials = tickets = out  # never read
    with device_of(x):
        _skinny_kernel[(num_tiles, tiles.splits)](
            x, weight, out, out if add is None else add, partials, tickets, T, N, K, x.stride(0),
            0 if add is None else add.stride(0), blocks // tiles.splits, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, BLOCK_T=block_t(T), SPLIT=tiles.splits > 1, EVEN_K=K % tiles.block_k == 0,
            HAS_ADD=add is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    return out


_launched: dict[tuple, Tiles] = {}  # (N, K, BLOCK_T, x dtype, out dtype, device) -> the tiles linear runs


def linear(x: Tensor, weight: Tensor, out_dtype: torch.dtype, add: Tensor | None = None) -> Tensor:
    """x [T, K] @ weight [N, K]^T (+ add [T, N]) -> [T, N] in out_dtype, with the first tiles of the rule's order
    that launch on this device (found on the shape's first call, eager or captured, then kept)."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype, device=x.device)
    key = (*weight.shape, block_t(x.shape[0]), x.dtype, out_dtype, x.device)
    if key in _launched:
        return launch(x, weight, out, _launched[key], add)
    _launched[key] = launch_first_fitting(x, weight, out, tile_order_for(x, weight), add)
    return out


def tile_order_for(x: Tensor, weight: Tensor) -> list[Tiles]:
    """tile_rule.tile_order for this shape on x's device (its SM count and opt-in shared memory per block)."""
    props = cuda_properties(x.device)
    return tile_order(*weight.shape, block_t(x.shape[0]), props.multi_processor_count,
                      props.shared_memory_per_block_optin)


def launch_first_fitting(x: Tensor, weight: Tensor, out: Tensor, order: list[Tiles],
                         add: Tensor | None = None) -> Tiles:
    """Launches the first tiles of `order` that this device can run and returns them: Triton raises OutOfResources
    before launching a binary whose shared memory (or threads) the device lacks, so nothing half-ran."""
    error = None
    for tiles in order:
        try:
            launch(x, weight, out, tiles, add)
            return tiles
        except OutOfResources as exc:
            error = exc
    raise RuntimeError(f"linear: none of the tilings {', '.join(map(str, order))} fits {x.device} "
                       f"(weight {tuple(weight.shape)}, {x.shape[0]} rows)") from error
