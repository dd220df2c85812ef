"""The disaggregated ingress's check of a request's structured output constraint, before its admission queue.

The engines compile a constraint against their vocabulary (engine/structured_output.py: the decode engine when it
admits the request, the prefill engine when the prompt arrives) and refuse one that does not compile with a
ValueError, the API's 400. Coming from the decode admission, that 400 would wait behind the requests queued for
decode room (or be a 503 for a full queue). So the router first parses the constraint as vLLM's frontend validates
one (`validate_xgrammar_grammar`): xgrammar's own parsers, which need no vocabulary and take well under a
millisecond however large the model's, with the engine's words for what fails. The compilation itself stays the
engines' (it costs the vocabulary and is cached where it is used); what parses but does not compile is still
refused there, with a 400 as well.
"""

from __future__ import annotations

import json

from k3serve.engine.sampling_params import StructuredOutputsParams
from k3serve.engine.structured_output import JSON_MAX_WHITESPACE, _xgrammar_message, choice_grammar, import_xgrammar


def check_constraint(constraint: StructuredOutputsParams | None) -> None:
    """ValueError, worded as the engine's, for a constraint whose schema, regex or grammar does not parse (or an
    ingress without xgrammar); nothing for none. json_object is one fixed schema, always valid."""
    if constraint is None or constraint.json_object:
        return
    xgr = import_xgrammar()
    kind = constraint.kind
    try:
        if kind == "json":
            json.loads(constraint.json)  # the engine's message for text that is not JSON at all
            xgr.Grammar.from_json_schema(constraint.json, max_whitespace_cnt=JSON_MAX_WHITESPACE)
        elif kind == "regex":
            xgr.Grammar.from_regex(constraint.regex)
        else:
            xgr.Grammar.from_ebnf(choice_grammar(constraint.choice) if kind == "choice" else constraint.grammar)
    except (RuntimeError, ValueError) as e:  # xgrammar raises RuntimeError for what it cannot read
        raise ValueError(f"structured output {kind} does not compile: {_xgrammar_message(e)}") from None
