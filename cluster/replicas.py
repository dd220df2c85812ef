"""Handles on prefill and decode replicas, whatever runs them.

The router (`cluster/router.py`) talks to replicas through these two small protocols. In-process
workers (`PrefillWorker`, `DecodeWorker`, `--launcher local`) satisfy them directly; Ray actors
are wrapped by `RayPrefillReplica` and `RayDecodeReplica`, which turn each call into an actor call
and a decode feed (`DecodeWorker.feed`: per engine step, the deltas of every request admitted
through it) into a Ray streaming generator. A replica that dies surfaces as an exception from the
call in flight; a feed cut by its replica's death raises `ReplicaDiedError` (a 503, not a 500).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol

from k3serve.cluster.errors import ReplicaDiedError

if TYPE_CHECKING:
    from k3serve.engine.outputs import EngineStats
    from k3serve.engine.stream_types import Item
    from k3serve.engine.sampling_params import SamplingParams
    from k3serve.prefill.messages import HandoffTarget, PrefillResult
    from k3serve.transfer.control import Reservation


class PrefillReplica(Protocol):
    name: str

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: "SamplingParams", target: "HandoffTarget"
    ) -> "PrefillResult": ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> "EngineStats": ...

    async def metrics_text(self) -> str: ...


class DecodeReplica(Protocol):
    name: str

    async def addresses(self) -> tuple[str, ...]: ...

    async def admit(
        self, request_id: str, prompt_token_ids: list[int], params: "SamplingParams", feed: str
    ) -> "Reservation": ...

    def feed(self, feed_id: str) -> AsyncIterator[list[tuple[str, "Item"]]]: ...

    async def abort_request(self, request_id: str) -> None: ...

    async def stats(self) -> "EngineStats": ...

    async def metrics_text(self) -> str: ...


def _process_gone_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rx

    return rx.RayActorError, rx.WorkerCrashedError, rx.ObjectLostError


class _RayReplica:
    def __init__(self, name: str, actor: Any) -> None:
        self.name, self.actor = name, actor

    async def stats(self):
        return await self.actor.stats.remote()

    async def metrics_text(self) -> str:
        return await self.actor.metrics_text.remote()


class RayPrefillReplica(_RayReplica):
    """A prefill worker in a Ray actor (see cluster/actors.py)."""

    async def prefill(self, request_id, prompt_token_ids, params, target):
        return await self.actor.prefill.remote(request_id, prompt_token_ids, params, target)

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)


class RayDecodeReplica(_RayReplica):
    """A decode worker in a Ray actor; its control address changes when Ray restarts it."""

    async def addresses(self) -> tuple[str, ...]:
        return tuple(await self.actor.control_addresses.remote())

    async def admit(self, request_id, prompt_token_ids, params, feed: str):
        return await self.actor.admit.remote(request_id, prompt_token_ids, params, feed)

    async def feed(self, feed_id: str):
        import ray

        refs = self.actor.feed.options(num_returns="streaming").remote(feed_id)
        try:
            async for ref in refs:
                yield await ref
        except _process_gone_errors() as e:
            raise ReplicaDiedError(f"decode replica {self.name} died") from e
        finally:  # the consumer left (router closing): end the feed there too, aborting its requests
            with contextlib.suppress(Exception):  # already ended, or the actor is gone
                ray.cancel(refs)

    async def abort_request(self, request_id: str) -> None:
        await self.actor.abort_request.remote(request_id)
