"""One line a stage of long work, on stdout: what starts, then how long it took.

    with stage("writing the k3-tiny checkpoint"):   # k3serve: writing the k3-tiny checkpoint ...
        make_checkpoint(...)                         # k3serve: writing the k3-tiny checkpoint: done in 2.9 s

A stage that raises prints `failed after X s` and re-raises. Lines are flushed at once (a server's log, a
pipe). Thread: any; stages nest, each printing its own two lines.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator, TextIO

PREFIX = "k3serve: "


def say(text: str, out: TextIO | None = None) -> None:
    """One `k3serve: ` line, flushed."""
    print(PREFIX + text, file=out or sys.stdout, flush=True)


@contextlib.contextmanager
def stage(what: str, out: TextIO | None = None) -> Iterator[None]:
    """Print `what ...` now and `what: done in X s` (or `failed after X s`) when the block ends."""
    say(f"{what} ...", out)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        say(f"{what}: failed after {time.perf_counter() - start:.1f} s", out)
        raise
    say(f"{what}: done in {time.perf_counter() - start:.1f} s", out)
