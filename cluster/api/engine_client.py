"""The one thing the ingress needs from a backend: `EngineClient`.

A colocated `AsyncEngine`, a prefill/decode router or a remote replica all serve the same
OpenAI routes as long as they implement this protocol. Contract:

- `generate` yields `RequestDelta`s until one has `finished=True`. It raises `ValueError` for a
  request the backend cannot serve and `EngineOverloadedError` (cluster/errors.py) when it has
  no capacity, both before the first delta.
- Closing the iterator early (client gone) must free the request; the ingress also calls
  `abort(request_id)`, which must be harmless for an unknown or finished id.
- `check_health` returns when the backend can take requests and raises otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from k3serve.engine.stream_types import GenerateRequest
    from k3serve.engine.outputs import RequestDelta
    from k3serve.model.tokenizer import Tokenizer


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: "Tokenizer"  # chat templates and token counting
    model_name: str  # the model id clients see (/v1/models)
    max_model_len: int  # prompt + generated tokens, at most

    def generate(self, request: "GenerateRequest") -> AsyncIterator["RequestDelta"]: ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None: ...
