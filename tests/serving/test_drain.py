"""A real `k3serve serve` stopped by SIGTERM while a long stream is in flight (cluster/serve.py `_GracefulStop`,
cluster/api/drain.py): at once /health answers 503 and a new request 503 "shutting down" (a load balancer stops
routing here, a client retries elsewhere) while the stream runs to its last token, after which the process exits 0.
Past --drain-timeout-seconds, or at a second SIGTERM, the stream is aborted with an error event and [DONE] rather
than a cut connection, and the process exits promptly."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from _server_harness import Server, ServerSpec, launch

EXIT_AFTER_S = 10.0  # the last request's end -> the process gone (engines shut down) on a 2-core host


class _Stream:
    """One streamed completion in a thread: its events as they come."""

    def __init__(self, server: Server, max_tokens: int) -> None:
        self.events: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None
        body = {"model": server.model, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        self._thread = threading.Thread(target=self._read, args=(f"{server.url}/v1/completions", body))
        self._thread.start()
        assert self.first.wait(30), "no first event"

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.first.set()
        except BaseException as e:  # the test asserts there was none
            self.error = e
            self.first.set()

    def join(self) -> None:
        self._thread.join(60)
        assert self.error is None, repr(self.error)

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


def _sigterm_during_a_stream(server: Server, max_tokens: int) -> _Stream:
    stream = _Stream(server, max_tokens)
    server.process.send_signal(signal.SIGTERM)
    return stream


def _exit_code_soon(server: Server) -> int:
    return server.process.wait(EXIT_AFTER_S)


@pytest.mark.parametrize("spec", [
    ServerSpec(mode="colocated", launcher="local"),
    ServerSpec(transfer="local", launcher="local"),
], ids=lambda s: s.id)
def test_sigterm_drains_the_stream_in_flight_and_refuses_new_work(tiny_checkpoint: Path, spec: ServerSpec) -> None:
    with launch(spec, tiny_checkpoint) as server:
        stream = _sigterm_during_a_stream(server, max_tokens=200)
        time.sleep(0.3)  # the signal handled
        health = httpx.get(f"{server.url}/health", timeout=5)
        late = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2},
                          timeout=5)
        assert health.status_code == 503
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
        assert server.process.poll() is None  # still serving the stream
        stream.join()
        chunks = stream.chunks()
        assert chunks[-1]["usage"]["completion_tokens"] == 200  # every token, not cut
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert stream.events[-1] == "[DONE]"
        assert _exit_code_soon(server) == 0
        assert "draining: 1 request(s) in flight" in server.log_text()


@pytest.mark.parametrize("extra_args, second_signal", [
    (("--drain-timeout-seconds", "0.5"), False),
    ((), True),  # the default 30 s drain, ended by a second SIGTERM
], ids=["drain-timeout", "second-sigterm"])
def test_a_stream_past_the_drain_ends_with_an_error_event(tiny_checkpoint: Path, extra_args: tuple[str, ...],
                                                          second_signal: bool) -> None:
    spec = ServerSpec(mode="colocated", launcher="local", extra_args=extra_args)
    with launch(spec, tiny_checkpoint) as server:
        stream = _sigterm_during_a_stream(server, max_tokens=1000)
        if second_signal:
            time.sleep(0.3)
            server.process.send_signal(signal.SIGTERM)
        cut_at = time.monotonic()
        stream.join()
        assert time.monotonic() - cut_at < 5.0
        assert stream.events[-1] == "[DONE]"
        error = json.loads(stream.events[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
        tokens = sum(len(c["choices"][0]["text"]) > 0 for c in stream.chunks() if "choices" in c and c["choices"])
        assert 0 < tokens < 1000
        assert _exit_code_soon(server) == 0
        assert "aborting 1 request(s) still in flight" in server.log_text()
