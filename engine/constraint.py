"""A request's structured output constraint as xgrammar parses it, before any vocabulary: what the disaggregated
ingress checks before it queues a request (as vLLM's frontend does) and what the engines then compile against
their tokenizer (`structured_output.py`). Imports neither torch nor, until a constraint comes, xgrammar."""

from __future__ import annotations

import json
import re
from typing import Any

from k3serve.engine.sampling_params import StructuredOutputsParams

XGRAMMAR_REQUIREMENT = "xgrammar==0.2.8"

JSON_MAX_WHITESPACE = 32
"""Whitespace characters a JSON output may put between two of its elements (vLLM lets xgrammar allow any number).
Enough to pretty-print 7 levels deep at an indent of 4; but a model that falls into emitting whitespace must
move on, and a schema of bounded values gives a bounded output (finishes within a bounded max_tokens)."""


class ConstraintCompileError(ValueError):
    """A request's schema, regex, choice or grammar does not compile: the API's 400, which the ingress counts as a
    refusal of that constraint's kind."""


def import_xgrammar() -> Any:
    """The xgrammar module; ValueError (a 400 at the API) where it is not installed."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"structured outputs need the xgrammar package ({XGRAMMAR_REQUIREMENT}), which this "
                         f"engine cannot import: {e}") from None
    return xgrammar


def xgrammar_message(error: Exception) -> str:
    """xgrammar's error without its C++ source location ("[13:01:18] /project/cpp/x.cc:83: ...")."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())
    return text.removeprefix("Check failed: (error.empty()) is false: ")


def choice_grammar(choice: tuple[str, ...]) -> str:
    """An EBNF grammar whose only sentences are the choices (vLLM compiles a choice the same way). Each is a JSON
    string literal, whose escapes xgrammar's EBNF reads; non-ASCII characters stay as they are."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def parse_constraint(constraint: StructuredOutputsParams) -> Any:
    """The xgrammar Grammar of `constraint`: its schema, regex or grammar parsed, which needs no vocabulary (the
    disaggregated ingress checks a request with this before queueing it, as vLLM's frontend does; the engines
    compile the result against theirs). ValueError naming what does not parse, in the engine's words."""
    xgr = import_xgrammar()
    kind = constraint.kind
    try:
        if kind in ("json", "json_object"):
            schema = constraint.json if kind == "json" else '{"type": "object"}'
            json.loads(schema)  # a clean message for text that is not JSON at all
            return xgr.Grammar.from_json_schema(schema, max_whitespace_cnt=JSON_MAX_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(constraint.regex)
        return xgr.Grammar.from_ebnf(choice_grammar(constraint.choice) if kind == "choice" else constraint.grammar)
    except (RuntimeError, ValueError) as e:  # xgrammar raises RuntimeError for a constraint it cannot read
        raise ConstraintCompileError(f"structured output {kind} does not compile: {xgrammar_message(e)}") from None
