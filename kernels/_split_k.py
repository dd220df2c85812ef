"""Ticket counters of split-K kernels that reduce in the same launch: each split of a tile writes its fp32
partial and takes a ticket from the tile's counter; the split that draws the last one sums the partials in
split order (the same sum whichever finishes last), stores the tile and puts the counter back to 0. No
memset, no second launch, no host sync, so the call is CUDA-graph capturable; launches that share counters
must not overlap (one stream)."""

from __future__ import annotations

import torch
from torch import Tensor

_tickets: dict[tuple[torch.device, int], Tensor] = {}  # (device, count) -> int32 [count], all 0 between launches


def split_tickets(device: torch.device, count: int) -> Tensor:
    """count int32 counters on device, zeroed once when first asked for (which must not be during a CUDA graph
    capture: run the shape once eagerly first) and kept for the process."""
    key = (device, count)
    if key not in _tickets:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K counters for {count} tiles must be allocated before CUDA graph capture; "
                               "run the shape once eagerly first")
        _tickets[key] = torch.zeros(count, dtype=torch.int32, device=device)
    return _tickets[key]
