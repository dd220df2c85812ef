"""Kimi's chat format: special-token names, the reference Jinja template, and a Python renderer.

`render_kimi_chat` reproduces, without Jinja, what the Kimi-K2-Instruct-0905 `chat_template`
(`KIMI_CHAT_TEMPLATE`, copied from the published tokenizer config) renders under Hugging Face's
settings (`trim_blocks`, `lstrip_blocks`) for text messages, tool results, assistant tool calls
and a `tools` list:

    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
    <|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>

(one line in reality: the template emits no newlines between turns). `render_jinja` renders any
HF chat template the way `transformers` does, when `jinja2` is installed.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

# The ids these names hold in Kimi-K2's and Kimi-Linear's `tiktoken.model` vocabulary (the base
# vocabulary is 163584 tokens; unnamed ids in 163584..163839 are `<|reserved_token_{id}|>`).
KIMI_SPECIAL_TOKENS: dict[str, int] = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590,
    "<|end_header_id|>": 163591,
    "[EOT]": 163593,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<think>": 163606,
    "</think>": 163607,
    "[UNK]": 163838,
    "[PAD]": 163839,
}

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# moonshotai/Kimi-K2-Instruct-0905 `chat_template.jinja`, verbatim (whitespace quirks included:
# the tool-declaration and tool-result bodies keep their indentation). It leaves the last message
# open (no `<|im_end|>`) when add_generation_prompt is false, so a partial assistant turn can be
# continued. (The first K2-Instruct release also put a newline after a system/tool role header.)
KIMI_CHAT_TEMPLATE = """\
{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>
  # Tools
  {{ tools | tojson }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
  {%- endif -%}
  
  {%- set role_name =  message.get('name') or  message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}
    <|im_system|>{{role_name}}<|im_middle|>
  {%- endif -%}

  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
    {%- if message['content'] -%}{{ message['content'] }}{%- endif -%}
    <|tool_calls_section_begin|>
    {%- for tool_call in message['tool_calls'] -%}
      {%- set formatted_id = tool_call['id'] -%}
      <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
    {%- endfor -%}
    <|tool_calls_section_end|>
  {%- elif message['role'] == 'tool' -%}
    ## Return of {{ message.tool_call_id }}
    {{ message['content'] }}
  {%- elif message['content'] is string -%}
    {{ message['content'] }}
  {%- elif message['content'] is not none -%}
    {% for content in message['content'] -%}
      {% if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
        <|media_start|>image<|media_content|><|media_pad|><|media_end|>
      {% else -%}
        {{ content['text'] }}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {% if (loop.last and add_generation_prompt) or not loop.last %}<|im_end|>{% endif %}
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%}"""

_ROLE_MARKER = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}


def message_text(content: Any) -> str | None:
    """A message's content as one string: a string as is, `{"type": "text"}` parts joined.

    Raises ValueError for any other part type (images etc. are not served yet) or shape.
    """
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"unsupported message content part type {kind!r}: only 'text' parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` with list-of-parts content joined into a string (see message_text)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} needs a string 'role'")
        out.append({**m, "content": message_text(m.get("content"))})
    return out


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """The `tojson` filter `transformers` installs for chat templates."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_kimi_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """KIMI_CHAT_TEMPLATE's output, in Python. Messages must already be normalized."""
    out = []
    if tools:
        out.append(f"<|im_system|>tool_declare<|im_middle|>\n  # Tools\n  {_tojson(list(tools))}<|im_end|>")
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content")
        if i == 0 and role != "system":
            out.append(f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>")
        out.append(f"{_ROLE_MARKER.get(role, '<|im_system|>')}{m.get('name') or role}<|im_middle|>")
        if role == "assistant" and m.get("tool_calls"):
            out.append((content or "") + "<|tool_calls_section_begin|>")
            for call in m["tool_calls"]:
                args = call["function"]["arguments"]
                args = args if isinstance(args, str) else _tojson(args)
                out.append(f"<|tool_call_begin|>{call['id']}<|tool_call_argument_begin|>{args}<|tool_call_end|>")
            out.append("<|tool_calls_section_end|>")
        elif role == "tool":
            out.append(f"## Return of {m.get('tool_call_id', '')}\n    {'' if content is None else content}")
        elif content is not None:
            out.append(content)
        if add_generation_prompt or i < len(messages) - 1:
            out.append("<|im_end|>")
    if add_generation_prompt:
        out.append("<|im_assistant|>assistant<|im_middle|>")
    return "".join(out)


def render_jinja(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                 tools: Sequence[Mapping[str, Any]] | None = None, **context: Any) -> str:
    """Render an HF chat template the way `transformers` does. Needs `jinja2` (ImportError if not)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        tools=list(tools) if tools else None, **context
    )
