"""Structured output through the disaggregated ingress (the real router over in-process prefill and decode workers,
transfer "local", the tiny model; the harness of test_admission_queue.py, whose decode replica has one KDA slot).

- A constrained request is served whole across the handoff: the prefill engine samples the first token under the
  constraint and the decode engine goes on from there, so the text matches the regex whole, on every choice of n.
- A constraint the engine cannot compile is refused by the ingress itself with the engine's 400, at once, while the
  only decode slot is taken and the admission queue is full: not a 503 for the queue, not after a wait, and no
  engine sees it. The ingress parses (engine/structured_output.parse_constraint) where the engine compiles: for every kind, what
  one refuses the other refuses in the same words.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from k3serve.cluster.api import build_app
from k3serve.engine.constraint import parse_constraint
from k3serve.engine.sampling_params import StructuredOutputsParams
from k3serve.engine.structured_output import GrammarCompiler
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer

from test_admission_queue import occupy, serving, until, workers  # noqa: F401 (workers: a fixture)
from test_decode_feed import PROMPTS, _tokens

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

REGEX = "[ab]{5}"
BAD_REGEX_400 = {"message": "structured output regex does not compile: Regex parsing error at position 4: Unclosed '['",
                 "type": "invalid_request_error", "param": None, "code": 400}
CONSTRAINTS = {  # id: (constraint, whether it compiles)
    "regex": (StructuredOutputsParams(regex=REGEX), True),
    "regex-unclosed": (StructuredOutputsParams(regex="[ab"), False),
    "regex-bad-repeat": (StructuredOutputsParams(regex="a{2,1}"), False),
    "json": (StructuredOutputsParams(json={"type": "object", "properties": {"ok": {"type": "boolean"}}}), True),
    "json-unknown-type": (StructuredOutputsParams(json={"type": "no-such-type"}), False),
    "json-not-json": (StructuredOutputsParams(json="{not json"), False),
    "json-bad-ref": (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}), False),
    "json_object": (StructuredOutputsParams(json_object=True), True),
    "choice": (StructuredOutputsParams(choice=["a", 'quote " and \\ backslash', "ü"]), True),
    "grammar": (StructuredOutputsParams(grammar='root ::= "a" | "b"'), True),
    "grammar-undefined-rule": (StructuredOutputsParams(grammar="root ::= undefined_rule"), False),
    "grammar-no-root": (StructuredOutputsParams(grammar='start ::= "a"'), False),
}


def outcome(check, constraint: StructuredOutputsParams) -> str:
    try:
        check(constraint)
    except ValueError as e:
        return str(e)
    return "ok"


@pytest.mark.parametrize("constraint,compiles", CONSTRAINTS.values(), ids=CONSTRAINTS.keys())
def test_the_ingress_refuses_what_the_engine_refuses_in_its_words(tiny_checkpoint, constraint, compiles) -> None:
    engine = GrammarCompiler(Tokenizer.from_dir(tiny_checkpoint), ModelConfig.from_dir(tiny_checkpoint).vocab_size)
    refused = outcome(engine.compile, constraint)
    assert (refused == "ok") == compiles, refused
    assert outcome(parse_constraint, constraint) == refused


async def test_a_regex_holds_across_the_handoff_on_every_choice(workers, tiny_checkpoint) -> None:  # noqa: F811
    async with serving(workers, tiny_checkpoint) as router:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router, router.metrics)),
                                     base_url="http://ingress") as http:
            r = await http.post("/v1/completions", json={"prompt": "Say a or b:", "n": 3, "seed": 3, "max_tokens": 16,
                                                         "guided_regex": REGEX})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["stop"] * 3


async def test_a_constraint_that_does_not_compile_is_refused_before_the_queue(
    workers, tiny_checkpoint  # noqa: F811
) -> None:
    async with serving(workers, tiny_checkpoint, max_queued_requests=1) as router:
        occupant = await occupy(router)
        waiting = asyncio.create_task(_tokens(router, "waits", PROMPTS[1]))
        await until(lambda: router.admission.num_waiting == 1, "the queue full")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router, router.metrics)),
                                     base_url="http://ingress") as http:
            started = time.monotonic()
            r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "guided_regex": "[ab"})
            assert time.monotonic() - started < 1.0
        assert (r.status_code, r.json()) == (400, {"error": BAD_REGEX_400})
        assert router.admission.num_waiting == 1
        await occupant.aclose()
        await waiting
        assert set(router.decode[0].answered) == {"occupant", "waits"}
        assert router.prefill[0].asked == ["occupant", "waits"]
