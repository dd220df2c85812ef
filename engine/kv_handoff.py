"""The handoff seam: the one interface through which the prefill and decode workers and the transfer layer use
an engine.

Rank 0 of an engine is a `KVHandoff`, ranks > 0 are a `FollowerRank` (`join_follower`). What crosses the seam
are plain dataclasses: `BoundaryState` (a request's blocks and KDA slot at its prompt boundary) and `CacheView`
(one rank's cache, as transfer/layout.py addresses it); the engine types its signatures use (`TPGroup`,
`EngineStats`, `DeltaFeed`, `Item`) are named from here too. Every method names its thread:

    engine thread   inside a function run by `call` / `submit`, or a hook (checked: elsewhere it raises)
    event loop      the asyncio loop the worker serves on
    any             any thread

The roles and the prefill -> decode sequence are drawn in docs/design/handoff.md.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from k3serve.engine.async_engine import AsyncEngine, DeltaFeed
from k3serve.engine.block_pool import BlockPool
from k3serve.engine.config import EngineArgs
from k3serve.engine.follower import join_engine
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.outputs import EngineStats, RequestDelta
from k3serve.engine.request import Request
from k3serve.engine.runner import ModelRunner
from k3serve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from k3serve.engine.state_pool import StatePool
from k3serve.engine.stream_types import GenerateRequest, Item
from k3serve.engine.tp_group import TPGroup, follow_forever
from k3serve.model.batch import ModelCache
from k3serve.model.config import ModelConfig

__all__ = ["BoundaryState", "CacheView", "DeltaFeed", "EngineStats", "FollowerRank", "Item", "KVHandoff",
           "PoolPins", "TPGroup", "join_follower"]

T = TypeVar("T")


@dataclass(frozen=True)
class BoundaryState:
    """A request's state at its prompt boundary in one engine's pools: the MLA blocks that hold the KV of its
    first `num_tokens` tokens and the KDA slot that holds the state after them. On prefill a finished prompt's
    (`on_prompt_done`), on decode a reservation a handoff writes into (`reserve`). The same ids on every TP rank.
    Wave 2's extra state (a drafter's per-request state, offloaded blocks) is more fields here."""

    request_id: str
    block_ids: tuple[int, ...]  # [ceil(num_tokens / block_size)]
    slot_id: int
    num_tokens: int


@dataclass(frozen=True)
class CacheView:
    """One rank's cache, what a transfer agent registers and its layout describes (`CacheLayout.from_view`)."""

    cache: ModelCache
    model_config: ModelConfig
    tp_rank: int
    tp_size: int
    cache_dtype: torch.dtype  # the engine's dtype, which the peers' compatibility hash covers
    block_size: int


class PoolPins:
    """Pins on an engine's pools (`transfer.pins.StatePins`): a pinned block or slot is never handed out, even
    after its request freed it, until it is unpinned. Engine thread (the pools are the scheduler's)."""

    def __init__(self, block_pool: BlockPool, state_pool: StatePool) -> None:
        self._blocks, self._slots = block_pool, state_pool

    def pin(self, block_ids: Sequence[int], slot_ids: Sequence[int]) -> None:
        """All or nothing: a bad id (not allocated) raises with nothing left pinned."""
        pinned_blocks: list[int] = []
        pinned_slots: list[int] = []
        try:
            for block_id in block_ids:
                self._blocks.pin([block_id])
                pinned_blocks.append(block_id)
            for slot_id in slot_ids:
                self._slots.pin(slot_id)
                pinned_slots.append(slot_id)
        except Exception:
            self.unpin(pinned_blocks, pinned_slots)
            raise

    def unpin(self, block_ids: Sequence[int], slot_ids: Sequence[int]) -> None:
        self._blocks.unpin(block_ids)
        for slot_id in reversed(slot_ids):
            self._slots.unpin(slot_id)


class KVHandoff:
    """Rank 0 of an engine, as a prefill or decode worker drives it. Starts the engine (and its thread) now.

    `on_prompt_done` (engine thread): a request finished with its whole prompt computed (not aborted), before
    the engine frees its blocks and slot; pin what must outlive it (`pins`). `on_abort` (engine thread): after
    every abort of a request, known to the engine or not (a decode reservation is not). `before_step` (engine
    thread): before each step schedules, {request_id: why} of the adopted requests to fail now, each ending its
    stream with that error (a decode worker's re-check of landed state; `on_all_ranks` may be used in it)."""

    def __init__(
        self,
        args: EngineArgs,
        group: TPGroup | None = None,
        on_prompt_done: Callable[[BoundaryState], None] | None = None,
        on_abort: Callable[[str], None] | None = None,
        before_step: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        self._on_prompt_done = on_prompt_done
        self._group = group
        self._engine = AsyncEngine(args, group, on_finish=self._finished if on_prompt_done else None,
                                   on_abort=on_abort, before_step=before_step)
        llm = self._engine.engine  # read here once, before any step; fixed from now on (any thread)
        self.model_name: str = llm.model_name
        self.max_model_len: int = llm.args.max_model_len
        self.num_kda_heads: int = llm.config.kda.num_heads
        self.tp_size: int = group.world_size if group is not None else 1
        self.cache_view = CacheView(llm.runner.cache, llm.config, 0, self.tp_size, args.torch_dtype, args.block_size)
        self.pins = PoolPins(llm.scheduler.block_pool, llm.scheduler.state_pool)  # engine thread

    # ---- requests (event loop, unless said) -----------------------------------------------------------
    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestDelta]:
        """The request's deltas until it finishes (`AsyncEngine.generate`)."""
        return self._engine.generate(GenerateRequest(request_id, prompt_token_ids, params))

    def stream(self, request_id: str) -> AsyncIterator[RequestDelta]:
        """The deltas of a request that enters by `adopt`; registered now, so none is missed."""
        return self._engine.stream(request_id)

    def follow(self, request_id: str, feed: DeltaFeed) -> None:
        """`stream`, into the shared `feed` (`AsyncEngine.follow`)."""
        self._engine.follow(request_id, feed)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    def fail(self, request_id: str, error: BaseException) -> None:
        """Any thread: end the stream of `request_id`, if followed, with `error`."""
        self._engine.fail(request_id, error)

    async def grammar(self, constraint: StructuredOutputsParams | None) -> Any:
        """`constraint` compiled off the engine thread, for `adopt`; None for None; ValueError if it does not."""
        return await self._engine.grammar(constraint)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on the engine thread between two steps; its result (or exception)."""
        return await self._engine.call(lambda _: fn())

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Any thread: `call` for callers outside the event loop (gRPC handlers)."""
        return self._engine.submit(lambda _: fn())

    def shutdown(self) -> None:
        """Any thread: stop the engine thread and the followers (rank 0 announces "stop")."""
        self._engine.shutdown()

    # ---- engine thread -----------------------------------------------------------------------------
    def stats(self, num_reserved: int = 0) -> EngineStats:
        return self._llm().stats(num_reserved=num_reserved)

    def has_request(self, request_id: str) -> bool:
        """Whether the engine runs or queues `request_id`."""
        return request_id in self._llm().scheduler.requests

    def reserve(self, request_id: str, num_tokens: int) -> BoundaryState | None:
        """Blocks for `num_tokens` tokens of KV and one KDA slot for a handoff to land in; None if they are not
        free now (the caller answers "no capacity" rather than wait). Freed by `cancel`, or owned by `adopt`."""
        held = self._llm().reserve(num_tokens)
        return None if held is None else BoundaryState(request_id, tuple(held[0]), held[1], num_tokens)

    def cancel(self, state: BoundaryState) -> None:
        """Free a reservation that will not be adopted."""
        self._llm().cancel_reservation(list(state.block_ids), state.slot_id)

    def adopt(self, state: BoundaryState, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams,
              grammar: Any = None) -> None:
        """Continue the request whose prompt state landed in the reservation `state`, from its first token
        (`LLMEngine.add_prefilled_request`): it owns the reservation from now on, unless this raises
        ValueError (a prompt or constraint this engine cannot serve; the reservation is still the caller's)."""
        self._llm().add_prefilled_request(state.request_id, prompt_token_ids, first_token_id, params,
                                          list(state.block_ids), state.slot_id, grammar)

    def on_all_ranks(self, action: str, args: tuple, local: Callable[[], T]) -> list[T]:
        """Announce `(action, *args)` to the followers (each runs its `FollowerRank.serve` action of that name),
        run `local()` here, and return every rank's result, rank order. One rank: `[local()]`."""
        self._check_engine_thread()
        if self._group is None:
            return [local()]
        self._group.lead((action, *args))
        return self._group.gather(local())

    def _llm(self) -> LLMEngine:
        self._check_engine_thread()
        return self._engine.engine

    def _check_engine_thread(self) -> None:
        if not self._engine.on_engine_thread():
            raise RuntimeError("this KVHandoff method runs on the engine thread only (inside call or submit)")

    def _finished(self, request: Request) -> None:
        """The scheduler's `on_finish` (engine thread), before it frees the request's blocks and slot."""
        if (request.slot_id is None or request.finish_reason == "abort"
                or request.num_computed_tokens != request.num_prompt_tokens):
            return
        self._on_prompt_done(BoundaryState(request.request_id, tuple(request.block_ids), request.slot_id,
                                           request.num_prompt_tokens))


class FollowerRank:
    """Rank > 0 of a TP engine: its model and cache shards, and the loop that performs what rank 0 announces."""

    def __init__(self, group: TPGroup, runner: ModelRunner, view: CacheView) -> None:
        self._group, self._runner = group, runner
        self.cache_view = view

    def serve(self, actions: Mapping[str, Callable[..., Any]]) -> None:
        """Until rank 0 stops: run its steps (and a verify step's commit), and for each of its `on_all_ranks(action, args, ...)` the result of
        `actions[action](*args)` joins rank 0's gather."""
        def gathered(fn: Callable[..., Any]) -> Callable[..., None]:
            return lambda *args: self._group.gather(fn(*args))

        follow_forever(self._group, {"step": self._runner.execute, "commit": self._runner.commit_verified,
                                     **{k: gathered(fn) for k, fn in actions.items()}})

    def close(self) -> None:
        self._runner.close_offload()
        self._group.close()


def join_follower(
    rank: int, args: EngineArgs, init_method: str, num_threads: int | None = None, host: str = "127.0.0.1"
) -> FollowerRank:
    """Join rank 0's group at `init_method` as `rank` (its sockets on `host`) and load this rank's shards; the
    caller must `close()` it."""
    group, runner, config = join_engine(rank, args, init_method, num_threads, host)
    view = CacheView(runner.cache, config, rank, args.tensor_parallel_size, args.torch_dtype, args.block_size)
    return FollowerRank(group, runner, view)
