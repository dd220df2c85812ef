"""A request's structured-output fields -> the engine's one constraint (`StructuredOutputsParams`), as vLLM's OpenAI
server maps them:

    response_format {"type": "json_object"}                        -> json_object (any JSON object)
    response_format {"type": "json_schema", "json_schema": {...}}   -> json: its `schema`
    response_format {"type": "text"}                               -> no constraint
    guided_json | guided_regex | guided_choice | guided_grammar     -> json | regex | choice | grammar (vLLM's extras)
    structured_outputs {"json" | "json_object" | ...: value}        -> the same keys (vLLM's newer extra)
    tool_choice "required" | {"type": "function", ...} (chat)      -> json: the calls' schema (forced_tool_choice.py)

A request has at most one constraint: two fields asking for one is a 400 naming both (never one silently winning),
a forced tool choice with response_format json or a guided_* field too.
Only the shape is checked here; whether a schema, regex or grammar compiles is the engine's question, and its
ValueError becomes a 400 with its message like any other (serving.to_api_error).

The constraint covers the whole output, from its first token, as vLLM applies it without a reasoning parser: a
constrained chat request is served without the reasoning split (serving.prepare_chat), so `content` is all the
constrained text (a forced tool choice's text comes back as its calls instead). A thinking model could then not
think first; the served models do not reason under a constraint (the tiny test model never reasons at all), so this
stays the simple rule until one needs reasoning before its answer.
"""

from __future__ import annotations

from typing import Any

from k3serve.engine.sampling_params import StructuredOutputsParams

from .errors import bad_request
from .forced_tool_choice import forced_tool_schema
from .protocol import ChatCompletionRequest, _SamplingFields

_KINDS = ("json", "json_object", "regex", "choice", "grammar")  # StructuredOutputsParams' fields
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_of(body: _SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint, or None; a 400 naming the field for a wrong shape, the fields for two constraints."""
    asked = _asked_constraints(body)
    if len(asked) > 1:
        fields = list(asked)
        raise bad_request(f"a request takes one structured output constraint, got {len(fields)}: "
                          f"{', '.join(fields)}; keep one of them", fields[0])
    if not asked:
        return None
    (field, kwargs), = asked.items()
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise bad_request(f"{field}: {e}", field) from None


def constraint_kind(body: _SamplingFields) -> str | None:
    """The kind of the request's constraint, as the ingress's metrics label it: the engine's kind, but "tool_choice"
    for a forced tool choice (a json one to the engine); None without any. For a body `structured_outputs_of`
    accepted."""
    asked = _asked_constraints(body)
    if not asked:
        return None
    (field, kwargs), = asked.items()
    return field if field == "tool_choice" else next(iter(kwargs))


def _asked_constraints(body: _SamplingFields) -> dict[str, dict[str, Any]]:
    """Request field -> StructuredOutputsParams' arguments, for every field that asks for a constraint."""
    asked: dict[str, dict[str, Any]] = {}
    tool_schema = forced_tool_schema(body) if isinstance(body, ChatCompletionRequest) else None
    if tool_schema is not None:
        asked["tool_choice"] = {"json": tool_schema}
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        asked["response_format"] = {"json_object": True}
    elif response_format is not None and response_format.type == "json_schema":
        asked["response_format"] = {"json": response_format.json_schema.json_schema}
    for field, kind in _GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            asked[field] = {kind: value}
    if body.structured_outputs is not None:
        unknown = sorted(set(body.structured_outputs) - set(_KINDS))
        if unknown:
            raise bad_request(f"structured_outputs: k3serve does not implement {', '.join(map(repr, unknown))}; "
                              f"it takes one of {', '.join(_KINDS)}", "structured_outputs")
        asked["structured_outputs"] = dict(body.structured_outputs)
    return asked
