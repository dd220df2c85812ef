"""Weight-holding building blocks whose parameter names mirror the checkpoint's tensor names.

Each module records how its tensors split across tensor-parallel ranks in `tp_dims`
(param name -> dim sharded, or None for replicated); the loader reads that, so sharding rules
live next to the layer that relies on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from k3serve.kernels.linear import linear
from k3serve.kernels.norm import rms_norm


class Sharded(nn.Module):
    """A module whose parameters carry a tensor-parallel split rule."""

    def __init__(self) -> None:
        super().__init__()
        self.tp_dims: dict[str, int | None] = {}

    def add_param(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, tp_dim: int | None) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        self.register_parameter(name, param)
        self.tp_dims[name] = tp_dim
        return param

    def prepare_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Turn a checkpoint tensor into this parameter's full (unsharded) form; identity by default."""
        return tensor

    def process_weights_after_loading(self) -> None:
        """Derive, once per (re)load, what the forward would otherwise recompute from the weights every
        step; none by default. `KimiForCausalLM.process_weights_after_loading` calls it on every module."""


def keep_address(current: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """A derived weight refreshed in place on reload, so CUDA graphs captured over `current` read the new
    values; `value` itself when there is nothing to refresh (first load, or `value` already is `current`)."""
    if current is None or (current.shape, current.dtype, current.device) != (value.shape, value.dtype, value.device):
        return value
    if current.data_ptr() != value.data_ptr():
        current.copy_(value)
    return current


class Linear(Sharded):
    """y = x W^T, W [out, in]. tp_dim 0: column parallel (split out), 1: row parallel (split in)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, tp_dim: int | None = None) -> None:
        super().__init__()
        self.weight = self.add_param("weight", (out_features, in_features), dtype, tp_dim)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x W^T (+ add, summed before the output's one rounding) in out_dtype (default the weight's; fp32 for
        an unrounded partial sum): `kernels.linear.linear`."""
        return linear(x.to(self.weight.dtype), self.weight, out_dtype, add)


def stack_rows(current: torch.Tensor | None, linears: Sequence[Linear]) -> torch.Tensor:
    """The weights of projections that read the same input, stacked [sum of outs, in] so that one GEMM
    computes them all (vLLM's merged column-parallel linear): a small GEMM costs a launch whatever its size.

    Each linear's weight becomes a view of its rows, so the stack is no second copy, and the loader, which
    copies each published tensor (this rank's shard) into its per-name parameter, fills the stack in place.
    Owners stack at construction (`current` None), before any weight is loaded, so loading never holds two
    copies; `process_weights_after_loading` calls it again with the stack, returned as is while the weights
    are still its views, else (a parameter was replaced, e.g. moved by `Module.to`) refilled in place."""
    weights = [linear.weight for linear in linears]
    if current is not None and _rows_of(current, weights):
        return current
    stacked = keep_address(current, _concat_rows(weights))
    start = 0
    for w in weights:
        w.data = stacked[start : start + w.shape[0]]
        start += w.shape[0]
    return stacked


def _concat_rows(weights: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of the weights' rows, as copies into one new tensor: on the meta device (a checkpoint's shapes,
    the memory plan's weight count) torch.cat runs a Python meta function that imports torch._dynamo (~150 MB in
    the process, and a torchinductor folder in the temp root)."""
    out = torch.empty((sum(w.shape[0] for w in weights), *weights[0].shape[1:]), dtype=weights[0].dtype,
                      device=weights[0].device)
    start = 0
    for w in weights:
        out[start : start + w.shape[0]].copy_(w.detach())
        start += w.shape[0]
    return out


def _rows_of(stacked: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether `weights` are, in order, views of consecutive row blocks of `stacked` that cover it."""
    start = 0
    for w in weights:
        rows = stacked[start : start + w.shape[0]]
        if w.device != rows.device or w.data_ptr() != rows.data_ptr() or w.shape != rows.shape:
            return False
        start += w.shape[0]
    return start == stacked.shape[0]


def project(x: torch.Tensor, stacked: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """The outputs of the projections stacked in `stacked` (`stack_rows`), as column slices of one GEMM."""
    return linear(x.to(stacked.dtype), stacked).split(list(sizes), dim=-1)


class RMSNorm(Sharded):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.add_param("weight", (size,), dtype, None)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, out_dtype, out)
