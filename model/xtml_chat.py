"""Kimi K3's chat prompt (XTML) as segments: what K3's own encoder (`encoding_k3`, shipped with the checkpoint in
place of a Jinja template; vLLM's K3 renderer calls it) builds for a conversation.

    <|open|>message role="system" type="tool-declare"<|sep|># Tools ...<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>

(one line in reality). Order: the tool declarations, the thinking-effort note, the conversation, the tool_choice
and response_format notes, then the open assistant message with its first channel open: `think` with thinking on
(the output starts inside it), `response` with thinking off. A past assistant turn carries its think channel
(possibly empty) with thinking on and none with thinking off, its content in a response channel and its calls in a
tools channel (`type="string"` arguments raw, others JSON). Tool results are matched to the calls they answer by
`tool_call_id` and put in call order, each named by its call's function and 1-based position.

`chat_segments` returns (text, is_markup) pairs: a markup segment is one special token; every other segment is
tokenized on its own (K3's encoder runs BPE a segment at a time), as plain text, so a message's text cannot forge
structure. Bad input raises ValueError (a 400 at the HTTP layer).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

OPEN, CLOSE, SEP, END_OF_MESSAGE = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
K3_SPECIAL_TOKENS = ("[BOS]", "[EOS]", END_OF_MESSAGE, OPEN, CLOSE, SEP, "[UNK]", "[PAD]")
"""The K3 tokenizer's named special tokens, in id order from the base vocabulary's end (163584 in the release)."""
THINKING_EFFORTS = ("low", "high", "max")
TEMPLATE_KWARGS = ("thinking", "enable_thinking", "thinking_effort")
"""The chat_template_kwargs K3's encoder reads (vLLM's K3 renderer maps `enable_thinking` onto `thinking`)."""

Segment = tuple[str, bool]  # (text, is_markup)


def _escape(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, *attrs: tuple[str, Any]) -> list[Segment]:
    out: list[Segment] = [(OPEN, True), (tag, False)]
    for key, value in attrs:
        out += [(f" {key}", False), ('="', False), (_escape(value), False), ('"', False)]
    return [*[s for s in out if s[0]], (SEP, True)]


def _close(tag: str) -> list[Segment]:
    return [(CLOSE, True), (tag, False), (SEP, True)]


def _text(text: Any) -> list[Segment]:
    text = "" if text is None else str(text)
    return [(text, False)] if text else []


def _message(attrs: list[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    return [*_open("message", *attrs), *body, *_close("message"), (END_OF_MESSAGE, True)]


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted_keys(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _argument_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _call_arguments(arguments: Any) -> tuple[dict[str, Any], str | None]:
    """A call's arguments as (object, None), or ({}, raw text) when they are text that is not JSON (rendered back
    as the model wrote it)."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}, arguments
    if not isinstance(parsed, dict):
        raise ValueError("a Kimi K3 tool call's arguments must be a JSON object")
    return parsed, None


def _assistant(message: Mapping[str, Any], thinking: bool) -> list[Segment]:
    out: list[Segment] = []
    if thinking:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        out += [*_open("think"), *(_text(reasoning) if reasoning and str(reasoning).strip() else []),
                *_close("think")]
    out += [*_open("response"), *_text(message.get("content")), *_close("response")]
    calls = message.get("tool_calls")
    if calls:
        out += _open("tools")
        for index, call in enumerate(calls, start=1):
            function = call.get("function", call)
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise ValueError("a Kimi K3 tool call needs a function name")
            out += _open("call", ("tool", function["name"]), ("index", index))
            arguments, raw = _call_arguments(function.get("arguments"))
            if raw is not None:
                out += [*_open("json", ("type", "object")), *_text(raw), *_close("json")]
            for key, value in arguments.items():
                out += [*_open("argument", ("key", key), ("type", _argument_type(value))),
                        *_text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)),
                        *_close("argument")]
            out += _close("call")
        out += _close("tools")
    return out


def _in_call_order(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each run of tool results put in the order of the calls they answer (matched by tool_call_id: the call's id, or
    `<name>:<0-based position>`), each named by its call's function; a run with a result that matches no call stays
    as sent."""
    out: list[dict[str, Any]] = []
    calls: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        message = dict(messages[i])
        if message["role"] != "tool":
            if message["role"] == "assistant":
                calls = {}
                for position, call in enumerate(message.get("tool_calls") or [], start=1):
                    name = call.get("function", call).get("name")
                    aliases = [str(call["id"])] if call.get("id") is not None else []
                    for alias in [*aliases, f"{name}:{position - 1}"]:  # vLLM's K3 renderer also matches name:n
                        calls.setdefault(alias, (position, name))
            out.append(message)
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i]["role"] == "tool":
            run.append(dict(messages[i]))
            i += 1
        matched = [calls.get(str(m.get("tool_call_id"))) for m in run]
        if all(matched):
            order = sorted(range(len(run)), key=lambda k: (matched[k][0], k))
            run = [{**run[k], "tool": matched[k][1]} for k in order]
        out += run
    return out


def chat_segments(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
                  add_generation_prompt: bool = True, thinking: bool = True, thinking_effort: str | None = None,
                  tool_choice: str | None = None, response_format: Mapping[str, Any] | None = None) -> list[Segment]:
    """The K3 prompt of `messages` (normalized: text content) as segments. `tool_choice` "required" or "none" and a
    `response_format` of type json_object / json_schema add the system notes K3 was trained with."""
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"Kimi K3 supports thinking_effort (reasoning_effort) values {', '.join(THINKING_EFFORTS)} "
                         f"(or reasoning_effort 'none': no thinking), got {thinking_effort!r}")
    out: list[Segment] = []
    if tools:
        body = ("# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
                f"{_compact(_sorted_keys(list(tools)))}\n```")
        out += _message([("role", "system"), ("type", "tool-declare")], _text(body))
    if thinking and thinking_effort is not None:
        out += _note("thinking-effort", "`thinking_effort` guides on how much to think in your thinking channel (not "
                     "including the response channel), supported values include `low`, `medium`, `high`, and `max`."
                     f"\nNow the system is invoked with `thinking_effort={thinking_effort}`.")
    tool_index, last_calls = 0, []
    for message in _in_call_order(messages):
        role, name = message["role"], message.get("name")
        named = [("name", name)] if name else []
        if role in ("user", "system"):
            out += _message([("role", role), *named], _text(message.get("content")))
        elif role == "assistant":
            last_calls, tool_index = message.get("tool_calls") or [], 0
            out += _message([("role", "assistant"), *named], _assistant(message, thinking))
        elif role == "tool":
            tool_index += 1
            tool = message.get("tool") or name
            if tool is None and tool_index <= len(last_calls):
                tool = last_calls[tool_index - 1].get("function", {}).get("name")
            if tool is None:
                raise ValueError("a tool message must answer a call of the assistant turn before it (its "
                                 "tool_call_id), or name its tool")
            out += _message([("role", "tool"), ("tool", tool), ("index", tool_index)], _text(message.get("content")))
        else:
            raise ValueError(f"Kimi K3 chats have roles system, user, assistant and tool, not {role!r}")
    if tool_choice in ("required", "none"):
        must = "MUST call tools" if tool_choice == "required" else "MUST NOT call any tools"
        out += _note("tool-choice", f"The system is invoked with `tool_choice={tool_choice}`.\nYou {must} in the "
                     "next message.")
    kind = (response_format or {}).get("type")
    if kind in ("json_object", "json_schema"):
        text = (f"The system is invoked with `response_format={kind}`.\nYour response must be raw JSON data without "
                "markdown code blocks (```json) or any additional formatting.")
        if kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema", spec.get("json_schema", spec)) if isinstance(spec, dict) else spec
            text += f"\nThe JSON data must match the following schema:\n```json\n{_compact(_sorted_keys(schema))}\n```"
        out += _note("response-format", text)
    if add_generation_prompt:
        out += [*_open("message", ("role", "assistant")), *_open("think" if thinking else "response")]
    return out


def _note(kind: str, body: str) -> list[Segment]:
    """A system message the server adds for this request (K3 has no request fields for these)."""
    return _message([("role", "system"), ("type", kind)], _text(body.strip()))


def render_text(segments: Sequence[Segment]) -> str:
    """The prompt as one string (for reading and tests; the engine gets `Tokenizer.encode_segments`)."""
    return "".join(text for text, _ in segments)
