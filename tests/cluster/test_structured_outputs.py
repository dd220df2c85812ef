"""Structured output at the ingress: every request field that asks for a constraint maps onto the engine's one
`StructuredOutputsParams` as vLLM maps it, on both routes; a wrong shape is a 400 naming the field, two constraints
a 400 naming both fields. The constraint covers the whole output, so a constrained chat is never split into
reasoning. (What the constrained output looks like: tests/serving/test_structured_outputs_e2e.py.)"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from k3serve.cluster.api.errors import APIError
from k3serve.cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from k3serve.cluster.api.structured_outputs import structured_outputs_of
from k3serve.engine.sampling_params import StructuredOutputsParams
from k3serve.model.tokenizer import Tokenizer

from test_api import CHAT, HI, PROMPT, assert_error
from test_reasoning_api import ANSWER, THINKING, THOUGHT
from test_tool_calls_api import ASK, ScriptedEngine, ingress

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
ROUTES = {"chat": lambda **fields: ChatCompletionRequest(messages=HI, **fields),
          "completions": lambda **fields: CompletionRequest(prompt=PROMPT, **fields)}


@pytest.fixture(params=ROUTES, ids=ROUTES.keys())
def request_of(request):
    return ROUTES[request.param]


def refusal(request_of, **fields) -> tuple[str | None, str]:
    """(param, message) of the 400 a request with these fields gets: from validating the body (the app names the
    first field of the error's location) or from mapping it."""
    try:
        structured_outputs_of(request_of(**fields))
    except ValidationError as e:
        error = e.errors()[0]
        return str(error["loc"][0]), f"{'.'.join(map(str, error['loc']))}: {error['msg']}"
    except APIError as e:
        assert e.status == 400
        return e.param, e.message
    raise AssertionError(f"{fields} was accepted")


# ---- every field form -------------------------------------------------------------------------
FORMS = {  # id: (request fields, the constraint they ask for)
    "response_format-json_object": ({"response_format": {"type": "json_object"}},
                                    StructuredOutputsParams(json_object=True)),
    "response_format-json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "description": "yes or no", "schema": SCHEMA, "strict": True}}},
        StructuredOutputsParams(json=SCHEMA)),
    "guided_json-object": ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    "guided_json-text": ({"guided_json": '{"type": "integer"}'}, StructuredOutputsParams(json='{"type": "integer"}')),
    "guided_regex": ({"guided_regex": "[ab]{5}"}, StructuredOutputsParams(regex="[ab]{5}")),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
    "guided_grammar": ({"guided_grammar": 'root ::= "a" | "b"'}, StructuredOutputsParams(grammar='root ::= "a" | "b"')),
    "structured_outputs-json": ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    "structured_outputs-json_object": ({"structured_outputs": {"json_object": True}},
                                       StructuredOutputsParams(json_object=True)),
    "structured_outputs-regex": ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
    "structured_outputs-choice": ({"structured_outputs": {"choice": ["x"]}}, StructuredOutputsParams(choice=["x"])),
    "structured_outputs-grammar": ({"structured_outputs": {"grammar": 'root ::= "a"'}},
                                   StructuredOutputsParams(grammar='root ::= "a"')),
    "text-and-guided_regex": ({"response_format": {"type": "text"}, "guided_regex": "a+"},
                              StructuredOutputsParams(regex="a+")),
}


@pytest.mark.parametrize("fields,expected", FORMS.values(), ids=FORMS.keys())
def test_each_field_form_maps_to_its_constraint(request_of, fields, expected):
    assert structured_outputs_of(request_of(**fields)) == expected


def test_the_schema_reaches_the_engine_whole(request_of):
    body = request_of(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    assert json.loads(structured_outputs_of(body).json) == SCHEMA


@pytest.mark.parametrize("fields", [{}, {"response_format": {"type": "text"}}, {"response_format": None}],
                         ids=["nothing", "text", "null"])
def test_no_constraint_asked(request_of, fields):
    assert structured_outputs_of(request_of(**fields)) is None


# ---- refused ----------------------------------------------------------------------------------
CONFLICTS = {  # id: (request fields, the fields the error names, the param)
    "response_format-and-guided_regex": ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
                                         ["response_format", "guided_regex"]),
    "guided_json-and-guided_choice": ({"guided_json": SCHEMA, "guided_choice": ["a"]},
                                      ["guided_json", "guided_choice"]),
    "guided_grammar-and-structured_outputs": ({"guided_grammar": 'root ::= "a"', "structured_outputs": {"regex": "a"}},
                                              ["guided_grammar", "structured_outputs"]),
    "three": ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
               "guided_regex": "a", "guided_choice": ["a"]}, ["response_format", "guided_regex", "guided_choice"]),
}


@pytest.mark.parametrize("fields,named", CONFLICTS.values(), ids=CONFLICTS.keys())
def test_two_constraints_are_refused_naming_the_fields(request_of, fields, named):
    param, message = refusal(request_of, **fields)
    assert param == named[0]
    assert all(name in message for name in named), message


BAD_SHAPES = {  # id: (request fields, the param of the 400, words of its message)
    "json_schema-without-schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
                                   "response_format", "schema"),
    "json_schema-without-json_schema": ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    "json_schema-without-name": ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
                                 "response_format", "name"),
    "json_schema-misspelt-key": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": SCHEMA, "schemas": SCHEMA}}}, "response_format", "schemas"),
    "json_schema-schema-not-an-object": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": "object"}}}, "response_format", "schema"),
    "json_object-with-json_schema": ({"response_format": {"type": "json_object", "json_schema": {
        "name": "n", "schema": SCHEMA}}}, "response_format", "json_schema"),
    "response_format-structural_tag": ({"response_format": {"type": "structural_tag"}}, "response_format", "type"),
    "guided_choice-empty": ({"guided_choice": []}, "guided_choice", "non-empty"),
    "guided_choice-a-string": ({"guided_choice": "yes"}, "guided_choice", "list"),
    "guided_regex-empty": ({"guided_regex": ""}, "guided_regex", "non-empty"),
    "guided_json-empty-text": ({"guided_json": " "}, "guided_json", "non-empty"),
    "structured_outputs-two-kinds": ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
                                     "exactly one"),
    "structured_outputs-none": ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    "structured_outputs-unknown-key": ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
                                       "structured_outputs", "whitespace_pattern"),
    "guided_whitespace_pattern": ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
                                  "whitespace"),
}


@pytest.mark.parametrize("fields,param,words", BAD_SHAPES.values(), ids=BAD_SHAPES.keys())
def test_a_wrong_shape_is_refused_naming_the_field(request_of, fields, param, words):
    got_param, message = refusal(request_of, **fields)
    assert got_param == param and words in message, (got_param, message)


# ---- through the app --------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("route,body,param", [
    (CHAT, {"messages": HI, "guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format"),
], ids=["chat-conflict", "completions-missing-schema"])
async def test_the_app_answers_a_400_naming_the_field(http, route, body, param):
    assert_error(await http.post(route, json=body), 400, param=param)


@pytest.mark.anyio
async def test_a_constrained_chat_is_not_split_into_reasoning(tiny_checkpoint):
    """A model's think block (scripted: the tiny model never thinks) comes back whole as content under a constraint,
    its markers skipped as any special token, where without one it is split: the constraint covers it all."""
    engine = ScriptedEngine(Tokenizer.from_dir(tiny_checkpoint))
    engine.reply = engine.tokenizer.encode(THINKING)
    async with ingress(engine) as http:
        split = (await http.post(CHAT, json={"messages": ASK})).json()["choices"][0]["message"]
        whole = (await http.post(CHAT, json={"messages": ASK, "guided_regex": "(.|\n)*"})).json()["choices"][0]
    assert split == {"role": "assistant", "reasoning": THOUGHT, "reasoning_content": THOUGHT, "content": ANSWER}
    assert whole["message"] == {"role": "assistant", "content": THOUGHT + ANSWER}
    params = engine.requests[1].sampling_params
    assert params.structured_outputs == StructuredOutputsParams(regex="(.|\n)*") and not params.keep_special_token_ids
