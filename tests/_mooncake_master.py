"""A `mooncake_master` for tests: started as the mooncake package documents (with its HTTP metadata server), on free
loopback ports; a test may kill, freeze or thaw it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

MASTER = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"mooncake_master did not listen on {port}")


class Master:
    """A `mooncake_master` on free loopback ports (RPC and HTTP metadata), which a test may kill, freeze or thaw;
    `config` is the engines' kv_offload_mooncake_config."""

    def __init__(self, cwd: Path) -> None:
        self.cwd, self.rpc, self.http = cwd, _free_port(), _free_port()
        self.config = json.dumps({"master_server_addr": f"127.0.0.1:{self.rpc}",
                                  "metadata_server": f"http://127.0.0.1:{self.http}/metadata",
                                  "global_segment_size": 64 * 2**20, "local_buffer_size": 16 * 2**20, "timeout_s": 1.0})
        self.proc = self.start()

    def start(self) -> subprocess.Popen:
        with open(self.cwd / "master.log", "ab") as log:
            proc = subprocess.Popen([MASTER, f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
                                     "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                                     f"--http_metadata_server_port={self.http}"], stdout=log, stderr=subprocess.STDOUT,
                                    cwd=self.cwd)
        _wait_listening(self.rpc, proc)
        _wait_listening(self.http, proc)
        return proc

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """A frozen master runs again; a killed one is started anew on the same ports (empty)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        else:
            self.proc = self.start()

    def stop(self) -> None:
        self.thaw()
        self.proc.terminate()
        self.proc.wait(timeout=10)
