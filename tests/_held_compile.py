"""A structured output compile held deterministically: `HeldCompile` is a `GrammarCompiler.on_compile` hook that
waits in the compiling thread until the test releases it (a compile at K3's vocabulary takes tens to hundreds of
ms, the first ~1 s; this one takes as long as the test wants)."""

from __future__ import annotations

import asyncio
import threading

from k3serve.engine.sampling_params import StructuredOutputsParams

HOLD_TIMEOUT_S = 30.0


class HeldCompile:
    """Each compilation waits here until `release()`; `started` is set once one has arrived. Records the threads
    the compilations ran on."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.thread_names: list[str] = []
        self._released = threading.Event()

    def __call__(self, constraint: StructuredOutputsParams) -> None:
        self.thread_names.append(threading.current_thread().name)
        self.started.set()
        if not self._released.wait(HOLD_TIMEOUT_S):
            raise TimeoutError("the test never released the compile")

    def release(self) -> None:
        self._released.set()

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, HOLD_TIMEOUT_S), "no compilation started"
