"""Index plan of one chunked KDA call, built on the host and sent to the device in ONE non-blocking copy, so no
read-back drains the GPU queue mid-prefill (fla derives its chunk indices on the device, with a sync). Built
once per step from plain lists (`ForwardBatch.kda_chunk_plan`), shared by every KDA layer:

    packed int64 (each part padded to an even length), one pinned host buffer -> one async copy:
    | cu_seqlens [N+1] | chunk_indices [NT, 2] | chunk_offsets [N+1] | checkpoints [N, 3] |

chunk_indices / chunk_offsets follow fla's format (fla.ops.utils.index). Checkpoint row n is sequence n's: for
an offset p >= 1, the chunk j = (p-1) // C holding it (its first token row, its row in h) and m = p - C*j of its
tokens before the offset; for p = -1, m = 0 (the zero state). The formats in full and why one row per
sequence: docs/design/kda_chunk_plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._backend import to_device_async


@dataclass(frozen=True)
class ChunkPlan:
    """Everything a chunked KDA call needs to know about its sequences: the host lists it was built
    from (validated, so a call given a plan checks shapes only) and their device index tensors."""

    seq_lens: tuple[int, ...]  # [N] tokens of each sequence (host)
    checkpoint_offsets: tuple[int, ...] | None  # [N] -1 or 1..len of each sequence (host); None: none asked
    chunk_size: int
    device: torch.device  # where the index tensors live
    num_chunks: int  # NT over all sequences (= rows of the flattened chunk states)
    cu_seqlens: Tensor | None  # [N+1] int64 on the device; None for equal-length rows (no varlen)
    chunk_indices: Tensor | None  # [NT, 2] int64 (sequence, chunk within it); varlen only
    chunk_offsets: Tensor | None  # [N+1] int64 first chunk row of each sequence; varlen only
    checkpoints: Tensor | None  # [N, 3] int64 (first token row of chunk j, m (0: none), chunk row); None: none asked

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None


def check_checkpoint_offsets(offsets: list[int] | tuple[int, ...], seq_lens: list[int] | tuple[int, ...]) -> None:
    """Each offset is -1 (none) or 1..len of its sequence, one per sequence."""
    if len(offsets) != len(seq_lens) or not all(p == -1 or 1 <= p <= n for p, n in zip(offsets, seq_lens)):
        raise ValueError(f"checkpoint_offsets must be -1 or in [1, len_n], got {list(offsets)} "
                         f"for lengths {list(seq_lens)}")


def plan_chunks(seq_lens: list[int], varlen: bool, checkpoint_offsets: list[int] | None, chunk_size: int,
                device: torch.device) -> ChunkPlan:
    """seq_lens: tokens of each sequence (for equal-length rows, B copies of T); checkpoint_offsets:
    per sequence, -1 or 1..len. Both are validated here, on the host."""
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"a chunk plan needs N >= 1 sequences of >= 1 token, got lengths {seq_lens}")
    if checkpoint_offsets is not None:
        check_checkpoint_offsets(checkpoint_offsets, seq_lens)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunks = [-(-n // chunk_size) for n in seq_lens]
    token_starts, chunk_starts = _prefix_sums(seq_lens), _prefix_sums(chunks)
    parts: list[list[int]] = []
    if varlen:
        indices: list[int] = []  # (n, i) for chunk i of sequence n, flat; filled by slices (C speed)
        for n, c in enumerate(chunks):
            pairs = [n] * (2 * c)
            pairs[1::2] = range(c)
            indices += pairs
        parts += [token_starts, indices, chunk_starts]
    rows = []
    for n, p in enumerate(checkpoint_offsets or ()):
        j = (p - 1) // chunk_size if p > 0 else 0  # the chunk holding the offset
        m = p - j * chunk_size if p > 0 else 0  # its tokens before the offset; 0: no checkpoint
        rows += [token_starts[n] + j * chunk_size, m, chunk_starts[n] + j]
    parts.append(rows)
    # Each part starts 16-byte aligned, as a tensor of its own would: Triton compiles a kernel per pointer
    # alignment, so an unaligned index tensor (an even N) would need other binaries, compiled mid-serving.
    values: list[int] = []
    starts = []
    for part in parts:
        starts.append(len(values))
        values += part + [0] * (len(part) % 2)
    flat = to_device_async(values, torch.device(device))
    packed = [flat[start : start + len(part)] for start, part in zip(starts, parts)]
    cu, indices, offsets = (packed[0], packed[1].view(-1, 2), packed[2]) if varlen else (None, None, None)
    return ChunkPlan(
        seq_lens=tuple(seq_lens),
        checkpoint_offsets=None if checkpoint_offsets is None else tuple(checkpoint_offsets),
        chunk_size=chunk_size,
        device=flat.device,  # with its index ("cuda" -> "cuda:0"), as the inputs' device reads
        num_chunks=chunk_starts[-1],
        cu_seqlens=cu,
        chunk_indices=indices,
        chunk_offsets=offsets,
        checkpoints=None if checkpoint_offsets is None else packed[-1].view(-1, 3),
    )


def _prefix_sums(values: list[int]) -> list[int]:
    out = [0]
    for x in values:
        out.append(out[-1] + x)
    return out
