"""The ranks > 0 of a TP engine as child processes of the launcher (`--launcher local`), watched while the engine
starts, so a follower that fails fails the start at once, with its cause, instead of as rank 0's join timeout.
Every follower reports over a pipe (`_run_follower`):

    arrived   its code imported and its arguments unpickled: it joins the group next
    started   it reached its action loop (`follower_main` calls `on_started`)
    failed    why, from the import on (a process that dies without a word: its exit code)

`start_tp_engine` returns once every follower has started; the first to fail raises, naming the engine, the rank
and the cause, after the engine's processes are killed and a join under way aborted. How rank 0 joins while it
listens, and how the abort reaches it: docs/design/local_followers.md.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, TypeVar

from k3serve.engine.tp_group import TPGroup, leader_store

T = TypeVar("T")

_EXPLAIN_S = 1.0  # how long a failure of rank 0 waits for a follower's report that explains it


def start_tp_engine(
    name: str, tp: int, host: str, follower: Callable[..., None], follower_args: Callable[[int, str], tuple],
    build: Callable[[TPGroup], T],
) -> tuple[T, FollowerProcesses]:
    """Rank 0's worker `build(group)` of TP engine `name`, whose ranks 1..tp-1 run
    `follower(*follower_args(rank, init_method), on_started=...)` in spawned processes; returned with
    those processes once every rank has started. Stop the worker first (it releases the followers),
    then the processes. RuntimeError naming the rank when a follower fails to start."""
    store, init = leader_store(tp, host)
    followers = FollowerProcesses(name, tp, follower, lambda rank: follower_args(rank, init))
    worker = None
    try:
        followers.wait_until("arrived")
        client = store.clone()  # connected here: the store can close under the join from now on (TPGroup)
        group = followers.while_watching(lambda: TPGroup(0, tp, init, host=host, store=client))
        store = None  # every rank joined: its port closes
        try:
            worker = build(group)
        except BaseException as e:
            explained = followers.failure(_EXPLAIN_S)
            if explained is None:
                raise
            raise explained from e
        followers.wait_until("started")
        return worker, followers
    except BaseException:
        store = None  # a join under way fails at once, its thread ends (not at the join timeout)
        followers.kill()
        if worker is not None:
            with contextlib.suppress(Exception):  # its followers are gone: "stop" fails to reach them
                worker.shutdown()
        raise


class FollowerProcesses:
    """Ranks 1..tp-1 of TP engine `name`, each a spawned process running `target(*args_of(rank),
    on_started=...)` and reporting its start (module docstring)."""

    def __init__(self, name: str, tp: int, target: Callable[..., None], args_of: Callable[[int], tuple]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self._processes: dict[int, Any] = {}
        self._reports: dict[int, Connection] = {}  # rank -> its report pipe, until it has started
        self._reached: dict[int, str] = {}  # rank -> "spawned" | "arrived" | "started"
        try:
            for rank in range(1, tp):
                reader, writer = ctx.Pipe(duplex=False)
                payload = pickle.dumps((target, args_of(rank)))  # unpickled in `_run_follower`: reported
                process = ctx.Process(target=_run_follower, args=(writer, payload), daemon=True,
                                      name=f"{name}-rank{rank}")
                process.start()
                writer.close()  # the child holds the only writer: the pipe closes when it exits
                self._processes[rank], self._reports[rank], self._reached[rank] = process, reader, "spawned"
        except BaseException:
            self.kill()
            raise

    def wait_until(self, state: str) -> None:
        """Until every follower has reached `state` ("arrived" or "started"); the first failure raises."""
        order = ("spawned", "arrived", "started")
        while behind := [r for r, s in self._reached.items() if order.index(s) < order.index(state)]:
            for conn in wait([self._reports[r] for r in behind]):
                self._read(conn)

    def while_watching(self, fn: Callable[[], T]) -> T:
        """`fn()`, run in a daemon thread while the followers are watched: a follower failing first
        raises at once, and `fn` is left to finish alone (its result dropped)."""
        done_reader, done_writer = multiprocessing.Pipe(duplex=False)
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = fn()
            except BaseException as e:
                outcome["error"] = e
            finally:
                with contextlib.suppress(OSError):  # abandoned: nobody listens any more
                    done_writer.send(None)
                done_writer.close()

        threading.Thread(target=run, name=f"{self.name}-rank0-join", daemon=True).start()
        try:
            while True:
                ready = wait([done_reader, *self._reports.values()])
                if done_reader in ready:
                    break
                for conn in ready:
                    self._read(conn)
        finally:
            done_reader.close()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def failure(self, within_s: float) -> RuntimeError | None:
        """A follower's failure reported within `within_s` (what explains rank 0's own failure), or None."""
        deadline = time.monotonic() + within_s
        try:
            while self._reports and (left := deadline - time.monotonic()) > 0:
                for conn in wait(list(self._reports.values()), left):
                    self._read(conn)
        except RuntimeError as e:
            return e
        return None

    def stop(self, timeout_s: float = 30.0) -> dict[int, int | None]:
        """Wait for every process to exit (rank 0 said "stop"), killing those still alive after `timeout_s`.
        Returns each rank's exit code (None: it was still running, and was killed)."""
        deadline = time.monotonic() + timeout_s
        for process in self._processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        exit_codes = {rank: process.exitcode for rank, process in self._processes.items()}
        self.kill()
        return exit_codes

    def kill(self) -> None:
        """End every process now. Safe to call twice."""
        for process in self._processes.values():
            if process.is_alive():
                process.kill()
        for process in self._processes.values():
            process.join(5.0)
        for conn in self._reports.values():
            conn.close()
        self._reports.clear()

    def _read(self, conn: Connection) -> None:
        """One report of the follower on `conn`; a failure (or the pipe closed by its death) raises."""
        rank = next(r for r, c in self._reports.items() if c is conn)
        try:
            state, why = conn.recv()
        except EOFError:
            process = self._processes[rank]
            process.join(5.0)
            state, why = "failed", f"its process exited (exit code {process.exitcode}) before it started"
        if state == "failed":
            raise RuntimeError(f"{self.name}: TP rank {rank} failed to start: {why}")
        self._reached[rank] = state
        if state == "started":
            del self._reports[rank]
            conn.close()


def _run_follower(report: Connection, payload: bytes) -> None:
    """A follower process: `target(*args, on_started=...)` from the pickled `(target, args)`, its start
    reported on `report` (module docstring), an import of the follower's code that fails included. The
    exception of a failed start still propagates: the process exits non-zero, its traceback on stderr.
    One after the start is the process's own."""

    def started() -> None:
        report.send(("started", None))
        report.close()

    try:
        target, args = pickle.loads(payload)
        report.send(("arrived", None))
        target(*args, on_started=started)
    except BaseException as e:
        if not report.closed:
            with contextlib.suppress(OSError):  # the launcher gave up already
                report.send(("failed", f"{type(e).__name__}: {e}"))
        raise
