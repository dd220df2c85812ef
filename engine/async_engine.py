"""Streaming engine for servers: `generate()` yields deltas as tokens are produced; `abort()` ends the stream with
a last delta (finish_reason "abort"). Either that or a consumer that stops iterating frees everything the
request held.

One background thread owns the `LLMEngine` and is the only one that touches it (but for its thread-safe grammar
compiler); asyncio callers talk to it through a command queue and get deltas back once per event loop per step.
An idle engine sleeps on the queue. A constrained request whose grammar is not compiled yet waits aside while it
compiles, without stalling the others; one that does not compile ends its stream with the ValueError. Deltas go
to a request's own queue (`generate`, `stream`) or into a `DeltaFeed` shared by many requests (`follow`: one
batch a step, what a decode replica streams to a router). The threading in full: docs/design/async_engine.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections import defaultdict
from typing import Any, AsyncIterator, Callable, TypeVar

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.outputs import RequestDelta, RequestFailedError
from k3serve.engine.request import Request
from k3serve.engine.tp_group import TPGroup
from k3serve.engine.sampling_params import StructuredOutputsParams
from k3serve.engine.stream_types import EngineDeadError, GenerateRequest, Item


T = TypeVar("T")


def _ends_request(item: Item) -> bool:
    return isinstance(item, BaseException) or item.finished


def _item(delta: RequestDelta) -> Item:
    """A step's delta as its stream gets it: the error that ends it for a request that failed."""
    return delta if delta.error is None else RequestFailedError(delta.error)


class _Stream:
    """One request's deltas, for one consumer. `put` runs on the consumer's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Item] = asyncio.Queue()

    def put(self, request_id: str, item: Item) -> None:
        self.queue.put_nowait(item)


class DeltaFeed:
    """The deltas of many requests, handed to one consumer a step at a time: `batches()` yields,
    per engine step, every (request_id, delta or error) that step produced for the requests that
    `AsyncEngine.follow` put here, in order. Never blocks the engine: a consumer that falls
    behind gets a bigger next batch. `request_ids` are the followed requests not yet ended."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.request_ids: set[str] = set()
        self._pending: list[tuple[str, Item]] = []
        self._ready = asyncio.Event()

    def put(self, request_id: str, item: Item) -> None:
        self._pending.append((request_id, item))
        if _ends_request(item):
            self.request_ids.discard(request_id)
        self._ready.set()

    async def batches(self) -> AsyncIterator[list[tuple[str, Item]]]:
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch, self._pending = self._pending, []
            yield batch


_Sink = _Stream | DeltaFeed


def _deliver(batch: list[tuple[_Sink, str, Item]]) -> None:
    """On a consumer's loop: one engine step's items for that loop."""
    for sink, request_id, item in batch:
        sink.put(request_id, item)


class AsyncEngine:
    def __init__(
        self, args: EngineArgs | None = None, group: TPGroup | None = None,
        on_finish: Callable[[Request], None] | None = None, on_abort: Callable[[str], None] | None = None,
        before_step: Callable[[], dict[str, str]] | None = None, **engine_args: Any,
    ) -> None:
        """`on_finish`: the scheduler's hook (`Scheduler.on_finish`); `on_abort(request_id)`: after every abort;
        `before_step`: `LLMEngine`'s. All run on the engine thread."""
        self.engine = LLMEngine(args if args is not None else EngineArgs.from_kwargs(**engine_args), group, on_finish,
                                before_step)
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, _Sink] = {}  # where each followed request's deltas go
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._on_abort = on_abort
        self._awaiting_grammar: dict[str, GenerateRequest] = {}  # engine thread: added once their grammar is ready
        self._thread = threading.Thread(target=self._run, name="k3serve-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.args.max_model_len

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine thread has stopped."""
        self._check_alive()

    # ---- caller side (event loop) ---------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """Yield the request's deltas until it finishes. Raises ValueError for a bad request
        (before any delta), EngineDeadError if the engine thread failed."""
        self._check_alive()
        stream = self._open(request.request_id, _Stream())
        self._commands.put(("add", request))
        async for delta in self._follow(request.request_id, stream):
            yield delta

    def stream(self, request_id: str) -> AsyncIterator[RequestDelta]:
        """Deltas of a request that enters the engine by other means (a handoff adopted through
        `call`). Registered now, so nothing emitted after this call is missed."""
        self._check_alive()
        return self._follow(request_id, self._open(request_id, _Stream()))

    def follow(self, request_id: str, feed: DeltaFeed) -> None:
        """Send the deltas of a request that enters the engine by other means into `feed`, from
        now until its last delta (or error). Aborting it is the feed owner's job."""
        self._check_alive()
        self._open(request_id, feed)
        feed.request_ids.add(request_id)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps; return (or raise) its result."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Thread-safe form of `call` for callers outside the event loop (e.g. gRPC handlers)."""
        self._check_alive()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(("call", (fn, future)))
        return future

    async def grammar(self, constraint: StructuredOutputsParams | None) -> Any:
        """`constraint` compiled against this engine's vocabulary off the engine thread (the compiler is
        thread-safe), for a request that enters the engine by other means (`LLMEngine.add_prefilled_request`'s
        `grammar`); None for None. ValueError for a constraint that does not compile."""
        if constraint is None:
            return None
        return await asyncio.wrap_future(self.engine.structured_outputs.compiler.compile_async(constraint))

    def fail(self, request_id: str, error: BaseException) -> None:
        """End the stream of `request_id` (if anyone follows it) by raising `error` there."""
        self._emit(request_id, error)

    def _open(self, request_id: str, sink: _Sink) -> _Sink:
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request_id {request_id!r}")
            self._streams[request_id] = sink
        return sink

    async def _follow(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestDelta]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # consumer gave up (disconnect, cancellation) or an error: free it
                self._commands.put(("abort", request_id))
            with self._lock:
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)

    def on_engine_thread(self) -> bool:
        """Whether the caller runs on the engine thread (inside `call` / `submit`, or a hook)."""
        return threading.current_thread() is self._thread

    def _check_alive(self) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine thread has stopped: {self._error!r}")

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished()
                if not self._drain_commands(block):
                    self.engine.close()
                    return
                self._emit_all([(delta.request_id, _item(delta)) for delta in self.engine.step()])
        except BaseException as e:  # surface to every waiting caller, never hang them
            self._error = e
            with self._lock:
                followed = list(self._streams)
            self._emit_all([(rid, EngineDeadError(f"engine failed: {e!r}")) for rid in followed])
            try:  # release the TP followers (if the group still works), rather than leave them waiting
                self.engine.close()
            except BaseException:
                pass

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one when idle. False on shutdown."""
        try:
            cmd = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, arg = cmd
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "grammar":  # a compile that `_add` started has ended
                request, grammar = arg
                if self._awaiting_grammar.get(request.request_id) is request:  # not aborted meanwhile
                    del self._awaiting_grammar[request.request_id]
                    self._add(request, grammar)
            elif kind == "abort":
                awaiting = self._awaiting_grammar.pop(arg, None)
                delta = self.engine.abort_request(arg) if awaiting is None else self._abort_unadmitted(awaiting)
                if delta is not None:  # ends a consumer still iterating (abort() from elsewhere)
                    self._emit(arg, delta)
                if self._on_abort is not None:
                    self._on_abort(arg)
            elif kind == "call":
                fn, future = arg
                if future.set_running_or_notify_cancel():  # a caller that gave up (cancelled) runs nothing
                    try:
                        result = fn(self.engine)
                    except Exception as e:  # the caller gets it; the engine keeps serving
                        future.set_exception(e)
                    else:
                        future.set_result(result)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request: GenerateRequest, grammar: concurrent.futures.Future | None = None) -> None:
        """Engine thread: `request` into the engine, with its compiled grammar (`grammar`, done) if constrained. A
        constraint not compiled yet starts compiling on the compiler's threads; the request waits aside until
        that compile's "grammar" command comes back here. A bad request ends its stream with the ValueError."""
        constraint = request.sampling_params.structured_outputs
        if grammar is None and constraint is not None:
            grammar = self.engine.structured_outputs.compiler.compile_async(constraint)
            if not grammar.done():
                self._awaiting_grammar[request.request_id] = request
                grammar.add_done_callback(lambda done: self._commands.put(("grammar", (request, done))))
                return
        try:
            compiled = None if grammar is None else grammar.result()
        except ValueError as e:
            self._emit(request.request_id, e)
            return
        except Exception as e:  # a compile that failed otherwise fails its request, not the engine thread
            self._emit(request.request_id, RequestFailedError(f"structured output compile failed: {e!r}"))
            return
        try:
            self.engine.add_request(request.prompt, request.sampling_params, request.request_id, compiled)
        except ValueError as e:
            self._emit(request.request_id, e)

    def _abort_unadmitted(self, request: GenerateRequest) -> RequestDelta:
        """The last delta of a request aborted while its grammar compiled: the engine never held it."""
        prompt = request.prompt
        num_prompt_tokens = len(self.engine.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
        return RequestDelta(request_id=request.request_id, new_token_ids=[], new_text="", finished=True,
                            finish_reason="abort", logprobs=None, num_prompt_tokens=num_prompt_tokens,
                            num_output_tokens=0)

    def _emit(self, request_id: str, item: Item) -> None:
        self._emit_all([(request_id, item)])

    def _emit_all(self, items: list[tuple[str, Item]]) -> None:
        """Route items to their sinks: one `call_soon_threadsafe` per consumer loop. A request's
        last item unregisters it here, so a late delta (after an abort) goes nowhere."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, str, Item]]] = defaultdict(list)
        with self._lock:
            for request_id, item in items:
                sink = self._streams.get(request_id)
                if sink is None:
                    continue
                if _ends_request(item):
                    del self._streams[request_id]
                by_loop[sink.loop].append((sink, request_id, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the consumer's event loop is closed: nobody is listening
                pass
