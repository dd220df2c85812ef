"""Plain-torch lookup of one vocab shard's rows: the foreign ids pointed at row 0 for the gather, their rows
zeroed after."""

from __future__ import annotations

import torch
from torch import Tensor


def shard_embedding(weight: Tensor, token_ids: Tensor, start: int, out: Tensor | None) -> Tensor:
    local = token_ids - start
    elsewhere = (local < 0) | (local >= weight.shape[0])
    rows = torch.index_select(weight, 0, local.masked_fill(elsewhere, 0), out=out)
    return rows.masked_fill_(elsewhere[:, None], 0)
