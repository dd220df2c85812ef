"""Specification: the ingress counts structured outputs, through the real app over the real engine (the tiny model).

- a request with a constraint counts once in k3serve:structured_output_requests_total, labelled by its kind: the
  engine's kind (response_format json_schema -> json, guided_regex -> regex, ...), tool_choice for a forced tool
  choice; a request without one counts nothing;
- a constraint that does not compile is a 400 counted in k3serve:structured_output_refusals_total by its kind (and
  in request_errors by its status, like any 400); a constraint with the wrong shape is a 400 of the request, never a
  refusal of its kind (the constraint was never read);
- the engine's compile seconds, which a colocated ingress exports beside its own (`IngressMetrics.include`): a
  request with a new schema observes one compilation, the same schema again none (a cache hit).
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from k3serve.cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from k3serve.cluster.api.structured_outputs import constraint_kind
from k3serve.engine.structured_output_metrics import grammar_compile_metrics

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Yes or no?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}, "required": ["answer"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


async def served_metrics(http) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from GET /metrics."""
    text = (await http.get("/metrics")).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_json_schema_counts_its_kind_and_one_compile_the_cached_repeat_none(http, metrics):
    metrics.include(grammar_compile_metrics().collectors)  # as a colocated deployment does
    name = metrics.model_name
    request = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.0, "response_format": JSON_SCHEMA}
    compiles, hits = ("k3serve:structured_output_compile_seconds_count", (("model_name", name),)), \
        ("k3serve:structured_output_grammar_cache_hits_total", (("model_name", name),))
    before = await served_metrics(http)
    assert (await http.post(CHAT, json=request)).status_code == 200
    after_first = await served_metrics(http)
    assert (await http.post(CHAT, json=request)).status_code == 200
    after_second = await served_metrics(http)
    assert after_second[("k3serve:structured_output_requests_total", (("kind", "json"), ("model_name", name)))] == 2
    assert after_first[compiles] - before[compiles] == 1  # a fresh engine: the schema is new to it
    assert (after_second[compiles], after_second[hits]) == (after_first[compiles], after_first[hits] + 1)


async def test_a_request_without_a_constraint_counts_none(http, metrics):
    assert (await http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2})).status_code == 200
    assert not metrics.structured_outputs.collect()[0].samples


async def test_a_bad_regex_is_a_refusal_of_its_kind(http, metrics):
    name = metrics.model_name
    r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 4, "guided_regex": "[ab"})
    assert r.status_code == 400 and "regex does not compile" in r.json()["error"]["message"]
    assert metrics.structured_outputs.labels(name, "regex")._value.get() == 1
    assert metrics.structured_output_refusals.labels(name, "regex")._value.get() == 1
    assert metrics.errors.labels(name, "400")._value.get() == 1


async def test_a_constraint_of_the_wrong_shape_is_no_refusal(http, metrics):
    r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 4, "guided_regex": "a",
                                                 "guided_choice": ["x"]})
    assert r.status_code == 400
    assert not metrics.structured_output_refusals.collect()[0].samples
    assert not metrics.structured_outputs.collect()[0].samples


@pytest.mark.parametrize("fields, kind", [
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "auto"}, None),
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_choice": ["a", "b"]}, "choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar"),
])
def test_constraint_kind(fields, kind):
    assert constraint_kind(ChatCompletionRequest(messages=MESSAGES, **fields)) == kind


def test_constraint_kind_of_a_completion():
    assert constraint_kind(CompletionRequest(prompt="a", guided_json=SCHEMA)) == "json"
