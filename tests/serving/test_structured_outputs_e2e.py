"""Structured output end to end, with the `openai` client, on real `k3serve serve` processes: the disaggregated
server (Ray, Mooncake, 1P1D: the first token is sampled under the constraint on the prefill engine, the rest on the
decode engine, which must resume the constraint after it) and the colocated one.

Spec (the tiny model has random weights: its text is noise, so only a constraint can give it a shape):
- response_format json_schema with a small schema that must end: the content parses and validates, and the choice
  ends by itself (finish_reason "stop": the engine bounds JSON whitespace, 32 characters a gap, so MAX_TOKENS
  covers the object whole); json_object gives a JSON object.
- guided_choice: the text is one of the choices, on every choice of `n` and of a prompt batch.
- guided_regex `[ab]{5}`: the text matches it whole.
- Streamed, each gives the same text as not streamed (greedy), and the disaggregated server the colocated text.
- A constraint the engine cannot compile (bad regex, schema or grammar) is a 400 with the engine's message, the same
  words on both servers (the disaggregated ingress refuses it before its admission queue), streamed or not.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

openai = pytest.importorskip("openai")  # test extras; the GPU machine has neither
jsonschema = pytest.importorskip("jsonschema")

from _server_harness import Server
from test_bad_requests import assert_openai_error
from test_openai_e2e import MESSAGES, PROMPTS, any_server, client_of  # noqa: F401 (any_server: a fixture)

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
MAX_TOKENS = 256  # > the schema's whitespace gaps full (at most 5 x 32) and its other 16 characters, a token each
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
CHOICES = ["red", "green", "blue"]
REGEX = "[ab]{5}"
SAMPLED = {"temperature": 1.0, "seed": 7}  # no ignore_eos: a constrained choice ends when its constraint does


def chat(server: Server, stream: bool = False, **request) -> tuple[str, str]:
    """(content, finish_reason) of one chat choice, streamed or not."""
    with client_of(server) as client:
        out = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                             stream=stream, **request)
        if not stream:
            return out.choices[0].message.content, out.choices[0].finish_reason
        chunks = [c for c in out if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


def complete(server: Server, stream: bool = False, **request) -> tuple[str, str]:
    """(text, finish_reason) of one completion choice, streamed or not."""
    with client_of(server) as client:
        out = client.completions.create(model=server.model, prompt=PROMPTS[3], max_tokens=MAX_TOKENS, stream=stream,
                                        **request)
        if not stream:
            return out.choices[0].text, out.choices[0].finish_reason
        chunks = [c for c in out if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_content_validates(any_server: Server, stream: bool) -> None:
    content, finish = chat(any_server, stream, response_format=JSON_SCHEMA_FORMAT, temperature=0.0)
    jsonschema.validate(json.loads(content), SCHEMA)
    assert finish == "stop", content
    text, finish = complete(any_server, stream, extra_body={"response_format": JSON_SCHEMA_FORMAT}, temperature=0.0)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert finish == "stop", text


@pytest.mark.timeout(300)
def test_json_object_is_an_object(any_server: Server) -> None:
    """Any object has no bound on its length: cut by max_tokens, it is still an object's beginning."""
    content, finish = chat(any_server, response_format={"type": "json_object"}, temperature=0.0)
    if finish == "stop":
        assert isinstance(json.loads(content), dict), content
    else:
        assert finish == "length" and content.startswith("{"), (finish, content)


@pytest.mark.timeout(300)
def test_guided_choice_on_every_choice(any_server: Server) -> None:
    """n = 3 on each of two prompts: six engine requests, each one constrained (seeded: not all the same pick)."""
    with client_of(any_server) as client:
        out = client.completions.create(model=any_server.model, prompt=PROMPTS[4:6], n=3, max_tokens=MAX_TOKENS,
                                        extra_body={"guided_choice": CHOICES}, **SAMPLED)
        chatted = client.chat.completions.create(model=any_server.model, messages=MESSAGES, n=2, max_tokens=MAX_TOKENS,
                                                 extra_body={"guided_choice": CHOICES}, **SAMPLED)
    assert len(out.choices) == 6 and all(c.text in CHOICES and c.finish_reason == "stop" for c in out.choices), \
        [c.text for c in out.choices]
    assert all(c.message.content in CHOICES for c in chatted.choices), [c.message.content for c in chatted.choices]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_guided_regex_matches_whole(any_server: Server, stream: bool) -> None:
    for request in (chat, complete):
        text, finish = request(any_server, stream, extra_body={"guided_regex": REGEX}, **SAMPLED)
        assert re.fullmatch(REGEX, text) and finish == "stop", (request.__name__, text, finish)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("constraint", [{"response_format": JSON_SCHEMA_FORMAT}, {"extra_body": {"guided_regex": REGEX}},
                                        {"extra_body": {"structured_outputs": {"choice": CHOICES}}}],
                         ids=["json_schema", "guided_regex", "structured_outputs-choice"])
def test_streamed_and_disaggregated_give_the_colocated_text(disagg_server: Server, colocated_server: Server,
                                                            constraint: dict) -> None:
    oracle = chat(colocated_server, **constraint, temperature=0.0)
    for server in (disagg_server, colocated_server):
        for stream in (False, True):
            assert chat(server, stream, **constraint, temperature=0.0) == oracle, (server.spec.id, stream)


UNCOMPILABLE = {  # id: (route, the constraint the engine cannot compile, the start of the engine's message)
    "regex": ("/v1/completions", {"guided_regex": "[ab"},
              "structured output regex does not compile: Regex parsing error at position 4: Unclosed '['"),
    "regex-chat": ("/v1/chat/completions", {"structured_outputs": {"regex": "(a"}},
                   "structured output regex does not compile: "),
    "schema": ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "no-such-type"}}}},
        'structured output json does not compile: Unsupported type "no-such-type"'),
    "schema-text": ("/v1/completions", {"guided_json": "{not json"},
                    "structured output json does not compile: Expecting property name"),
    "grammar": ("/v1/completions", {"guided_grammar": "root ::= undefined_rule"},
                "structured output grammar does not compile: "),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route,constraint,message", UNCOMPILABLE.values(), ids=UNCOMPILABLE.keys())
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_constraint_that_does_not_compile_is_a_400(any_server: Server, route: str, constraint: dict, message: str,
                                                     stream: bool) -> None:
    body = {"model": any_server.model, "max_tokens": 4, "stream": stream, **constraint,
            **({"messages": MESSAGES} if route.startswith("/v1/chat") else {"prompt": PROMPTS[0]})}
    error = assert_openai_error(httpx.post(f"{any_server.url}{route}", json=body, timeout=60), 400)
    assert error["message"].startswith(message), error
    with client_of(any_server) as client:  # the server still serves
        assert client.completions.create(model=any_server.model, prompt="ok", max_tokens=2).choices[0].text is not None


@pytest.mark.timeout(120)
def test_the_openai_client_sees_a_bad_request(any_server: Server) -> None:
    with client_of(any_server) as client, pytest.raises(openai.BadRequestError, match="regex does not compile"):
        client.completions.create(model=any_server.model, prompt="ok", max_tokens=2,
                                  extra_body={"guided_regex": "[ab"})
