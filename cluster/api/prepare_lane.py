"""`PrepareLane`: where a request's prepare (chat template, tokenization, its checks; serving.py) runs, so that no
prompt's size stalls the event loop every other request and /health share.

    body <= INLINE_BODY_BYTES   on the event loop: a small prompt costs less than a thread hop
    larger                      on a worker thread, at most TOKENIZE_THREADS at once (anyio's pool, a limiter):
                                the tokenizer releases the GIL while it encodes, and the template's Python
                                yields it between bytecodes, so the loop keeps serving meanwhile; a burst of
                                large prompts waits for a thread rather than holding a tokenization's memory each

A large prompt waits only behind other large ones; small ones never queue here. The text that prepare reads must
not change meanwhile (it is the request's own, parsed body). Cancellation (the client gone, a drain's abort) takes
effect once the thread's prepare returns.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")

INLINE_BODY_BYTES = 32 * 2**10
TOKENIZE_THREADS = 2  # of the ingress's cores: the rest serve the loop, the router and its RPCs


class PrepareLane:
    def __init__(self, threads: int = TOKENIZE_THREADS, inline_body_bytes: int = INLINE_BODY_BYTES) -> None:
        self.threads, self.inline_body_bytes = threads, inline_body_bytes
        self._limiter: anyio.CapacityLimiter | None = None  # made in the loop, on first use

    async def run(self, prepare: Callable[[], T], body_bytes: int) -> T:
        """`prepare()`'s result (or its exception), for a request whose body had `body_bytes` bytes."""
        if body_bytes <= self.inline_body_bytes:
            return prepare()
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.threads)
        return await anyio.to_thread.run_sync(prepare, limiter=self._limiter)
