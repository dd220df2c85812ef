"""A real `k3serve serve` in a subprocess, for end-to-end tests and benchmarks.

    spec = ServerSpec(transfer="nixl", decode_replicas=2)
    with launch(spec, model_dir) as server:       # waits for the printed URL and /health 200
        server.url, server.model, server.metrics(), server.actor_pids("DecodeActor")
    # exit: SIGTERM; the process must exit and every process it started (raylet, gcs_server,
    # actor workers) must be gone within STOP_DEADLINE_S, else ServerError (stragglers killed)

Each server gets its own short temp dir as TMPDIR (Ray's session dir, whose sockets need short
paths, lands under it) and HOME (Ray's token auth makes its token there) and no usage stats; the engines are
small (64 MiB of cache, max_model_len 1024, block size 16). The server's output goes to
`log_path`, whose tail is in every error message.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

START_DEADLINE_S = 120.0  # printed URL + /health 200 (Ray start, engines, first handshake) on a 2-core host
STOP_DEADLINE_S = 30.0  # SIGTERM -> process and all its descendants gone
SMALL_ENGINE_ARGS = ("--cache-memory-bytes", "67108864", "--max-model-len", "1024", "--block-size", "16")
SERVED_MODEL = "k3-tiny"
_URL = re.compile(r"k3serve: serving (\S+) on (http://\S+) \(model (\S+)\)")


class ServerError(RuntimeError):
    """The server did not start, did not stop, or left processes behind."""


@dataclass(frozen=True)
class ServerSpec:
    mode: str = "disaggregated"
    transfer: str = "mooncake"
    launcher: str = "ray"
    prefill_replicas: int = 1
    decode_replicas: int = 1
    prefill_tp: int = 1
    extra_args: tuple[str, ...] = ()
    embedded_default: bool = False  # `k3serve serve --port 0` alone: README command 1 (its model, engines, Ray)

    @property
    def id(self) -> str:
        """Readable test id: `colocated`, `mooncake-1P1D`, `nixl-1P2D-local`, `embedded-default`."""
        if self.embedded_default:
            return "embedded-default"
        if self.mode == "colocated":
            return "colocated"
        name = f"{self.transfer}-{self.prefill_replicas}P{self.decode_replicas}D"
        if self.prefill_tp > 1:
            name += f"-prefill-tp{self.prefill_tp}"
        return name if self.launcher == "ray" else f"{name}-{self.launcher}"

    def argv(self, model_dir: Path | str | None) -> list[str]:
        if self.embedded_default:
            return [sys.executable, "-m", "k3serve.cli", "serve", "--port", "0", *self.extra_args]
        args = [sys.executable, "-m", "k3serve.cli", "serve", "--model", str(model_dir),
                "--served-model-name", SERVED_MODEL, "--mode", self.mode, "--launcher", self.launcher,
                "--port", "0", *SMALL_ENGINE_ARGS]
        if self.mode == "disaggregated":
            args += ["--transfer", self.transfer, "--prefill-replicas", str(self.prefill_replicas),
                     "--decode-replicas", str(self.decode_replicas), "--prefill-tp", str(self.prefill_tp)]
        return args + list(self.extra_args)


def server_env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # An earlier test's in-process ray.init leaves RAY_AUTH_MODE=token in this process; a server inheriting it
    # before it imports Ray never gets its GCS up. The server's Ray chooses its own mode, as from a shell.
    env.pop("RAY_AUTH_MODE", None)
    env.update(
        TMPDIR=str(workdir), HOME=str(workdir / "home"), RAY_USAGE_STATS_ENABLED="0",
        PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
    )
    (workdir / "home").mkdir(exist_ok=True)
    return env


class Server:
    def __init__(self, spec: ServerSpec, process: subprocess.Popen, workdir: Path, log_path: Path) -> None:
        self.spec, self.process, self.workdir, self.log_path = spec, process, workdir, log_path
        self.url = ""
        self.model = SERVED_MODEL

    # ---- start ------------------------------------------------------------------------------
    def wait_ready(self, deadline_s: float = START_DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        while not self.url:
            match = _URL.search(self.log_text())
            if match:
                self.url, self.model = match.group(2), match.group(3)
                break
            if self.process.poll() is not None:
                raise ServerError(f"{self.spec.id}: exited with {self.process.returncode} before serving\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerError(f"{self.spec.id}: no URL printed within {deadline_s:.0f} s\n{self.log_tail()}")
            time.sleep(0.1)
        self.wait_healthy(max(1.0, deadline - time.monotonic()))

    def wait_healthy(self, deadline_s: float) -> None:
        deadline, last = time.monotonic() + deadline_s, None
        while time.monotonic() < deadline:
            try:
                last = httpx.get(f"{self.url}/health", timeout=5).status_code
                if last == 200:
                    return
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.2)
        raise ServerError(f"{self.spec.id}: /health not 200 within {deadline_s:.0f} s (last: {last})\n{self.log_tail()}")

    # ---- inspect ----------------------------------------------------------------------------
    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    def descendants(self) -> list[int]:
        return descendants(self.process.pid)

    def actor_pids(self, class_name: str) -> list[int]:
        """PIDs of this server's Ray workers hosting `class_name` actors (`ray::PrefillActor`)."""
        return [pid for pid in self.descendants() if _cmdline(pid).startswith(f"ray::{class_name}")]

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """/metrics as {(name, frozenset(labels.items())): value}."""
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def gauge(self, name: str, **labels: str) -> dict[frozenset, float]:
        """The series of `name` whose labels include `labels`, keyed by their label sets."""
        want = set(labels.items())
        return {key: v for (n, key), v in self.metrics().items() if n == name and want <= key}

    # ---- stop -------------------------------------------------------------------------------
    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> float:
        """SIGTERM; returns the seconds until the process and everything it started were gone."""
        tree = set(self.descendants())
        start = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(deadline_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _kill_all(tree)
            raise ServerError(f"{self.spec.id}: still running {deadline_s:.0f} s after SIGTERM\n{self.log_tail()}")
        tree |= set(_processes_mentioning(str(self.workdir)))
        while time.monotonic() - start < deadline_s:
            left = [pid for pid in tree if _alive(pid)]
            if not left:
                return time.monotonic() - start
            time.sleep(0.2)
        names = {pid: _cmdline(pid)[:80] for pid in left}
        _kill_all(left)
        raise ServerError(f"{self.spec.id}: processes left {deadline_s:.0f} s after SIGTERM: {names}\n{self.log_tail()}")


@contextlib.contextmanager
def launch(spec: ServerSpec, model_dir: Path | str | None, deadline_s: float = START_DEADLINE_S,
           keep_log: Path | None = None) -> Iterator[Server]:
    """Start, wait until healthy, yield; then stop and check that nothing is left behind."""
    workdir = Path(tempfile.mkdtemp(prefix="k3s-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(spec.argv(model_dir), stdout=log, stderr=subprocess.STDOUT, env=server_env(workdir),
                                   cwd=workdir, start_new_session=True)
    server = Server(spec, process, workdir, log_path)
    try:
        try:
            server.wait_ready(deadline_s)
        except BaseException:
            with contextlib.suppress(ServerError):
                server.stop(10.0)
            raise
        yield server
        server.stop()
    finally:
        if process.poll() is None:  # an error above: never leave it running
            _kill_all([process.pid, *server.descendants()])
        if keep_log is not None:
            keep_log.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                shutil.copy(log_path, keep_log)
        shutil.rmtree(workdir, ignore_errors=True)


# ---- /metrics ---------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = frozenset(_LABEL.findall(match.group(2) or ""))
            out[(match.group(1), labels)] = float(match.group(3))
    return out


# ---- processes (/proc, no psutil) -------------------------------------------------------------
@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    command: str  # its command line: `ray::DecodeActor`, `.../raylet --raylet_socket_name=...`
    rss_bytes: int  # resident, shared pages counted in full
    pss_bytes: int  # proportional: a page shared by n processes counts 1/n in each (sums to the tree's memory)


def tree_memory(root: int) -> list[ProcessMemory]:
    """`root` and every live descendant's memory, from /proc/PID/smaps_rollup (processes gone meanwhile skipped)."""
    out = []
    for pid in [root, *descendants(root)]:
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
        except (OSError, ValueError):
            continue
        kib = lambda key: int(fields[key].split()[0]) * 1024  # noqa: E731
        out.append(ProcessMemory(pid, _cmdline(pid), kib("Rss"), kib("Pss")))
    return out



def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _processes_mentioning(text: str) -> list[int]:
    return [pid for pid in _parents() if text in _cmdline(pid) and pid != os.getpid()]


def _kill_all(pids) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def serve(spec: ServerSpec, model_dir: Path, artifacts_dir: Path, tag: str) -> Iterator[Server]:
    """A fixture body: one server for the fixture's scope, its log kept under the artifacts dir."""
    with launch(spec, model_dir, keep_log=artifacts_dir / "server-logs" / f"{tag}-{spec.id}.log") as server:
        yield server
