"""The logit biases of a batch's rows, kept on the logits' device for as long as the batch keeps its rows: a
request's `logit_bias` map becomes host arrays once, and the batch's rows one packed buffer, copied in one copy
when the rows change and reused for every step they do not:

    host, a request:  token_ids [E_r] int64 | biases [E_r] fp32                       (made once)
    device, a batch:  | row * V + token_id [E] int64 | bias [E] fp32 |  one uint8 buffer, one copy a change
                       E = sum of E_r over the biased rows, in row order

A batch's rows are its `SamplingParams` objects, compared by identity; a params object's `logit_bias` is read
when it first reaches a batch (changing one after submission is not supported). Why, as vLLM v1's InputBatch
does it: docs/design/logit_bias.md.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch

from k3serve.engine.sampling_params import SamplingParams
from k3serve.kernels._backend import to_device_async


@dataclass(frozen=True)
class RequestBias:
    """One request's `logit_bias` as arrays, in the dict's order."""

    token_ids: np.ndarray  # [E_r] int64
    biases: np.ndarray  # [E_r] float32: each bias rounded to fp32 as torch.tensor(..., dtype=float32) does
    max_token_id: int

    @classmethod
    def of(cls, logit_bias: dict[int, float]) -> RequestBias:
        return cls(
            np.fromiter(logit_bias.keys(), dtype=np.int64, count=len(logit_bias)),
            np.fromiter(logit_bias.values(), dtype=np.float32, count=len(logit_bias)),
            max(logit_bias),
        )


class LogitBiasBatch:
    """Adds each row's bias to its logits; the device buffer is made again only when the rows change.

    `num_uploads` counts the buffers copied to the device so far (one a change of a biased batch's rows)."""

    def __init__(self) -> None:
        self._rows: list[SamplingParams] = []  # [N] the batch the buffer was made for; keeps their ids unique
        self._vocab_size = 0
        self._device: torch.device | None = None
        self._by_params: dict[int, RequestBias] = {}  # id(params) -> its arrays, for the params in _rows
        self._flat_ids: torch.Tensor | None = None  # [E] int64 on the device: row * V + token id
        self._biases: torch.Tensor | None = None  # [E] fp32 on the device
        self.num_uploads = 0

    def apply(self, logits: torch.Tensor, params: list[SamplingParams]) -> None:
        """`logits` [N, V] fp32, contiguous, modified in place: row i's biased tokens get params[i]'s biases
        (one indexed add for the batch). A batch whose rows carry no bias costs one scan of `params`."""
        if not any(p.logit_bias is not None for p in params):
            return
        if not logits.is_contiguous():
            raise ValueError("logits must be contiguous: the biases are added through its flat view")
        if not self._is_current(params, logits):
            self._upload(params, logits.shape[1], logits.device)
        logits.view(-1).index_add_(0, self._flat_ids, self._biases)

    def _is_current(self, params: list[SamplingParams], logits: torch.Tensor) -> bool:
        return (
            len(params) == len(self._rows)
            and logits.shape[1] == self._vocab_size
            and logits.device == self._device
            and all(map(operator.is_, params, self._rows))
        )

    def _upload(self, params: list[SamplingParams], vocab_size: int, device: torch.device) -> None:
        by_params: dict[int, RequestBias] = {}
        rows, entries = [], []
        for row, p in enumerate(params):
            if p.logit_bias is None:
                continue
            entry = by_params.get(id(p)) or self._by_params.get(id(p)) or RequestBias.of(p.logit_bias)
            by_params[id(p)] = entry
            if entry.max_token_id >= vocab_size:  # a flat index past its row would bias the next row
                raise ValueError(f"row {row}: logit_bias token id {entry.max_token_id} is outside the "
                                 f"vocabulary [0, {vocab_size})")
            rows.append(row)
            entries.append(entry)
        num_entries = [len(e.token_ids) for e in entries]
        num = sum(num_entries)
        packed = torch.empty(12 * num, dtype=torch.uint8, pin_memory=device.type == "cuda")
        host = packed.numpy()
        flat_ids = np.concatenate([e.token_ids for e in entries], out=host[: 8 * num].view(np.int64))
        flat_ids += np.repeat(np.asarray(rows, dtype=np.int64) * vocab_size, num_entries)
        np.concatenate([e.biases for e in entries], out=host[8 * num :].view(np.float32))
        on_device = to_device_async(packed, device)
        self._flat_ids = on_device[: 8 * num].view(torch.int64)
        self._biases = on_device[8 * num :].view(torch.float32)
        self._rows, self._vocab_size, self._device, self._by_params = list(params), vocab_size, device, by_params
        self.num_uploads += 1
