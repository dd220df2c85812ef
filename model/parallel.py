"""Tensor parallelism for one engine: which rank this is and how per-rank results are combined.

Head-sharded layers (KDA, MLA), column/row-parallel MLPs, expert-parallel routed experts and the
vocab-parallel embedding all produce per-rank partial sums of the hidden state; `all_reduce` combines
them. The vocab-parallel lm_head produces per-rank slices of the logits; `gather` brings them to rank 0,
the only rank that samples. Decode context parallelism (`dcp_size` > 1: MLA's latent KV split by sequence
over groups of `dcp_size` consecutive ranks, docs/design/dcp.md) exchanges queries and partial outputs within
a group: `dcp_all_gather`, `dcp_all_to_all`. All run on the engine's own process group when it has one (NCCL
on a CUDA engine whose ranks each have a GPU, else gloo: `engine/tp_group.py`), else on torch.distributed's
default group. With `world_size == 1` every call is a no-op, so single-process code pays nothing.

Every call runs synchronously on the caller's CUDA stream (`asyncOp` off, as `dist.all_reduce` without
`async_op` does): an NCCL collective is then one more kernel of the step, which a CUDA graph records
like any other, with no side stream to fork from and join back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    # The engine's own process group (`TPGroup.tensor_parallel()`); None: torch.distributed's
    # default group. Several TP engines in one process need their own.
    group: Any = field(default=None, compare=False, repr=False)
    # Ranks a DCP group: ranks [g*dcp_size, (g+1)*dcp_size) split every request's MLA latent KV by sequence
    dcp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside world size {self.world_size}")
        if self.dcp_size < 1 or self.world_size % self.dcp_size:
            raise ValueError(f"decode context parallel size {self.dcp_size} does not divide the tensor-parallel "
                             f"size {self.world_size}")

    @property
    def dcp_rank(self) -> int:
        """This rank's place in its DCP group: the page of every virtual block it holds."""
        return self.rank % self.dcp_size

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can record this rank's collectives: there are none (one rank), or they are
        NCCL's, kernels on the GPU. Gloo's copy CUDA tensors through the host and wait there."""
        return self.world_size == 1 or is_nccl(self.group)

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's slice of a dimension of `size`."""
        if size % self.world_size:
            raise ValueError(f"{what}={size} is not divisible by tensor-parallel size {self.world_size}")
        length = size // self.world_size
        return self.rank * length, length

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        if self.group is not None:
            _finish(self.group.allreduce([x], _ALL_REDUCE))
        else:
            dist.all_reduce(x)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` (the same shape and dtype on every rank) at rank 0 as one [world_size, *x.shape]
        tensor, in rank order; None on the other ranks. A gather, not an all-gather: the other ranks need none
        of it, and rank 0 receives the same bytes either way. Each rank's `x` lands in its own contiguous row
        of that one buffer (NCCL receives into each part's address as a flat run), so nothing concatenates."""
        if self.world_size == 1:
            return x.unsqueeze(0)
        x = x.contiguous()
        out = x.new_empty(self.world_size, *x.shape) if self.rank == 0 else None
        parts = None if out is None else list(out.unbind(0))  # views: the collective writes into `out`
        if self.group is not None:
            _finish(self.group.gather([parts] if parts is not None else [], [x], _GATHER_TO_0))
        else:
            dist.gather(x, parts, dst=0)
        return out

    def dcp_all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [W, *S] (W = dcp_size, the same shape on every rank): part s goes to DCP rank s of this rank's
        group; returns [W, *S], part s from DCP rank s. One all-to-all of the TP group, nothing sent outside
        the DCP group (its other splits are empty)."""
        W = self.dcp_size
        if W == 1:
            return x
        if x.shape[0] != W:
            raise ValueError(f"dcp_all_to_all wants [{W}, ...], got {tuple(x.shape)}")
        x = x.contiguous()
        out = torch.empty_like(x)
        first, part = self.rank - self.dcp_rank, x[0].numel()
        splits = [part if first <= s < first + W else 0 for s in range(self.world_size)]
        if self.group is not None:
            _finish(self.group.alltoall_base(out.view(-1), x.view(-1), splits, splits, _ALL_TO_ALL))
        else:
            dist.all_to_all_single(out.view(-1), x.view(-1), splits, splits)
        return out

    def dcp_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank of this rank's DCP group's `x` (the same shape everywhere): [W, *x.shape], in DCP rank order."""
        if self.dcp_size == 1:
            return x.unsqueeze(0)
        return self.dcp_all_to_all(x.unsqueeze(0).expand(self.dcp_size, *x.shape))


def is_nccl(group: Any) -> bool:
    """Whether `group` is an NCCL process group (never on a torch built without NCCL, such as the CPU one)."""
    return dist.is_nccl_available() and isinstance(group, dist.ProcessGroupNCCL)


def _finish(work: Any) -> None:
    """Wait for a collective's `Work`, where there is one: ProcessGroupNCCL with asyncOp off returns None (the
    collective is already queued on the caller's stream, nothing to join); gloo returns a `Work` to wait on."""
    if work is not None:
        work.wait()


def _on_callers_stream(options: Any) -> Any:
    """`options` with asyncOp off where torch has it (2.7+; before, NCCL always ran on its own stream and
    `wait()` joined it back, which a graph records too). Gloo ignores it."""
    if hasattr(options, "asyncOp"):
        options.asyncOp = False
    return options


# Made once: the process groups read their options, never change them, and an eager TP step makes two
# collectives a layer (building each call's options every call adds up over K3's 93 layers: docs/BENCHMARKS.md).
_ALL_REDUCE = _on_callers_stream(dist.AllreduceOptions())
_GATHER_TO_0 = _on_callers_stream(dist.GatherOptions())
_ALL_TO_ALL = _on_callers_stream(dist.AllToAllOptions())
_GATHER_TO_0.rootRank = 0


SINGLE = TensorParallel()
