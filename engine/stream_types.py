"""What a streaming engine takes and gives, as plain values: a `GenerateRequest` in, `Item`s out (a delta, or the
error that ends the request), `EngineDeadError` once its thread stopped. The ingress builds and reads them without
importing an engine (or torch); `async_engine.py` is the engine they go to.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.engine.outputs import RequestDelta
from k3serve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt: str | list[int]
    sampling_params: SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can make progress."""


Item = RequestDelta | BaseException  # a delta, or the error that ends the request
