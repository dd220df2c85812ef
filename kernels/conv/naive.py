"""Plain-torch depthwise causal convolution over packed sequences with a slot pool of conv states.

For sequence n with new tokens x_n [L, C] and slot s = state_indices[n]:

    window = [ conv_state[s] (W-1 older inputs, oldest first) | x_n ]      [W-1+L, C]
    y_t    = act( sum_j weight[:, j] * window[t + j] )                    t = 0..L-1
    conv_state[s] <- window[L:]   (the last W-1 pre-conv inputs; also right when L < W-1)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv1d(
    x: Tensor,  # [T, C]
    weight: Tensor,  # [C, W]
    conv_state: Tensor,  # [S, C, W-1], updated in place
    cu_seqlens: Tensor,  # [N+1]
    state_indices: Tensor,  # [N]
    activation: str | None = "silu",
) -> Tensor:
    W = weight.shape[1]
    wf = weight.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    bounds = cu_seqlens.tolist()
    for n, slot in enumerate(state_indices.tolist()):
        bos, eos = bounds[n], bounds[n + 1]
        window = torch.cat([conv_state[slot].float().T, x[bos:eos].float()])  # [W-1+L, C]
        y[bos:eos] = (window.unfold(0, W, 1) * wf).sum(-1)  # unfold: [L, C, W]
        conv_state[slot] = window[eos - bos :].T.to(conv_state.dtype)
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype)


def conv_verify(
    x: Tensor,  # [T, C]
    weight: Tensor,  # [C, W]
    conv_state: Tensor,  # [S, C, W-1], read only
    cu_seqlens: list[int],  # [N+1]
    state_indices: list[int],  # [N]
    activation: str | None = "silu",
) -> Tensor:
    """`causal_conv1d`'s outputs, the slots left as they were (`conv_commit` moves their windows). A token at a
    time, in a one-token step's shapes: the reduction over W and the activation round as a decode step's do
    (bit-identical; over a whole row at once the vectorized tails round differently)."""
    W = weight.shape[1]
    wf = weight.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for n, slot in enumerate(state_indices):
        bos, eos = cu_seqlens[n], cu_seqlens[n + 1]
        window = torch.cat([conv_state[slot].float().T, x[bos:eos].float()])  # [W-1+L, C]
        for t in range(eos - bos):
            row = (window[t : t + W].unfold(0, W, 1) * wf).sum(-1)  # [1, C]
            y[bos + t : bos + t + 1] = F.silu(row) if activation == "silu" else row
    return y.to(x.dtype)


def conv_commit(
    conv_state: Tensor,  # [S, C, W-1], updated in place
    x: Tensor,  # [T, C]: the verified pre-conv inputs
    cu_seqlens: list[int],  # [N+1]
    state_indices: list[int],  # [N]
    commit_lens: list[int],  # [N]
) -> None:
    """Slot n's window becomes the last W-1 inputs of [window | its first commit_lens[n] tokens] (copies)."""
    for n, (slot, length) in enumerate(zip(state_indices, commit_lens)):
        if length == 0:
            continue
        bos = cu_seqlens[n]
        window = torch.cat([conv_state[slot].float().T, x[bos : bos + length].float()])
        conv_state[slot] = window[length:].T.to(conv_state.dtype)
