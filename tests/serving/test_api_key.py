"""A real `k3serve serve` with an API key from $K3SERVE_API_KEY (how the Helm chart passes its Secret): the
OpenAI SDK with the key is served, with a wrong one gets AuthenticationError; /health stays open (the
harness waits on it), and the key shows nowhere in the server's output."""

from __future__ import annotations

from pathlib import Path

import pytest
openai = pytest.importorskip("openai")  # a test extra; the GPU machine has none

from _server_harness import ServerSpec, launch

KEY = "k3-e2e-key-9f8e7d6c"


def test_the_openai_client_needs_the_servers_key(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3SERVE_API_KEY", KEY)
    with launch(ServerSpec(mode="colocated", launcher="local"), tiny_checkpoint) as server:
        def client(api_key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=60)

        reply = client(KEY).chat.completions.create(model=server.model, max_tokens=2,
                                                     messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens <= 2 and reply.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.AuthenticationError) as refused:
            client("wrong").models.list()
        assert refused.value.status_code == 401 and KEY not in str(refused.value)
        log = server.log_text()
    assert "/v1 routes require the API key" in log and KEY not in log
