"""Helpers for tests that run real peers on this machine: a free TCP port, a TCP init method for a process
group, and a spawned process (a TP rank beside the test's own rank 0) that must exit cleanly."""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_init_method() -> str:
    """A torch.distributed init method on a free local port."""
    return f"tcp://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def spawned(target: Callable[..., None], *args: object, join_s: float = 20.0) -> Iterator[BaseProcess]:
    """target(*args) in a spawned process, started on entry. When the block ends without an error the process
    must exit 0 within join_s; whatever happens, it does not outlive the block."""
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    try:
        yield process
        process.join(join_s)
        assert process.exitcode == 0, f"{getattr(target, '__name__', target)} exited {process.exitcode}"
    finally:
        if process.is_alive():
            process.kill()
