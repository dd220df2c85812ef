"""End to end: `k3serve serve --speculative-config '<json>'` (a real server, local launcher) over Mooncake and
NIXL answers greedy completions with exactly the text the same model gives without speculation in process, its
decode replica accepted drafts (/metrics, vLLM's names, and the per-replica mean acceptance length that `k3serve
status` prints), and it stops cleanly. The model is tests/conftest.py's echo checkpoint, which repeats itself
enough for prompt lookup to be accepted; the model-based drafters (`drafters`: EAGLE, DSpark, draft_model at
K = 1, 4, 8) serve the same text from a Mooncake decode pool, and EAGLE from a colocated server."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams

from _server_harness import SERVED_MODEL, ServerSpec, launch

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
PROMPTS = [[21, 22, 23, 24], [301, 7, 301, 7, 301], list(range(40, 90))]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(echo_checkpoint: Path) -> list[str]:
    llm = LLM(str(echo_checkpoint), dtype="float32", cache_memory_bytes=64 << 20, max_model_len=1024, block_size=16)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))]


def _serve_greedy(spec: ServerSpec, checkpoint: Path) -> tuple[list[str], dict]:
    """A server of `spec`: its greedy completion of each of PROMPTS, then its /metrics samples; stopped after."""
    with launch(spec, checkpoint) as server:
        texts = []
        for prompt in PROMPTS:
            response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        return texts, server.metrics()


def _total(metrics: dict, name: str) -> float:
    return sum(v for (n, _), v in metrics.items() if n == name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transfer", ["mooncake", "nixl"])
def test_a_speculating_decode_pool_serves_the_non_speculative_text(echo_checkpoint: Path, reference: list[str],
                                                                   transfer: str) -> None:
    spec = ServerSpec(transfer=transfer, launcher="local", extra_args=("--speculative-config", SPEC))
    texts, metrics = _serve_greedy(spec, echo_checkpoint)
    assert texts == reference
    assert _total(metrics, "vllm:spec_decode_num_accepted_tokens_total") > 0, "the decode pool accepted no draft"
    assert any(name == "k3serve:spec_decode_mean_acceptance_length" and dict(labels)["pool"] == "decode" and v > 1
               for (name, labels), v in metrics.items())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("method", ["eagle", "dspark", "draft_model"])
def test_a_decode_pool_speculating_with_a_drafter_serves_the_non_speculative_text(
        echo_checkpoint: Path, drafters: dict[str, Path], reference: list[str], method: str, k: int) -> None:
    """A model-based drafter on the decode pool (Mooncake): the prompt's positions never pass through an EAGLE or
    DSpark drafter (the prefill pool ran them), so its first decode step drafts nothing and it drafts from the
    positions it computes; a draft_model recomputes the prompt from its tokens at the first decode step."""
    config = json.dumps({"method": method, "model": str(drafters[method]), "num_speculative_tokens": k})
    spec = ServerSpec(transfer="mooncake", launcher="local", extra_args=("--speculative-config", config))
    texts, metrics = _serve_greedy(spec, echo_checkpoint)
    assert texts == reference
    drafts = _total(metrics, "vllm:spec_decode_num_drafts_total")
    accepted = _total(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted > 0, f"the decode pool's {method} drafter proposed or got accepted nothing"


@pytest.mark.timeout(300)
def test_a_colocated_server_speculating_with_a_drafter_serves_the_non_speculative_text(
        echo_checkpoint: Path, drafters: dict[str, Path], reference: list[str]) -> None:
    """`k3serve serve --mode colocated` with an EAGLE drafter, through the OpenAI API."""
    config = json.dumps({"method": "eagle", "model": str(drafters["eagle"]), "num_speculative_tokens": 8})
    spec = ServerSpec(mode="colocated", launcher="local", extra_args=("--speculative-config", config))
    texts, metrics = _serve_greedy(spec, echo_checkpoint)
    assert texts == reference
    assert _total(metrics, "vllm:spec_decode_num_accepted_tokens_total") > 0
