"""A chat request's `chat_template_kwargs` and `reasoning_effort` -> the keywords its prompt is rendered with.

Kimi K3 (as vLLM's K3 renderer reads them): `thinking` (or `enable_thinking`, its other name; default on) opens
the think channel for the answer; `reasoning_effort` "low", "high" or "max" (or `thinking_effort` in the kwargs)
adds K3's thinking-effort note, "none" turns thinking off; an explicit kwarg wins over reasoning_effort. The K3
prompt also carries a tool_choice of "required" or "none" and a JSON `response_format` as system notes.

A constrained request (structured output, forced tool choice) is served without thinking: the constraint covers
the whole output from its first token, so the prompt opens the response channel; asking for thinking as well is
a 400. Kimi K2's template reads no keyword: any kwarg, or a reasoning_effort, is a 400 (vLLM would pass them to a
template that ignores them). A checkpoint's own Jinja template gets the kwargs as they are. Never ignored.
"""

from __future__ import annotations

from typing import Any

from k3serve.model.chat_template import KIMI_CHAT_TEMPLATE
from k3serve.model.tokenizer import Tokenizer
from k3serve.model.xtml_chat import TEMPLATE_KWARGS, THINKING_EFFORTS

from .errors import bad_request
from .protocol import ChatCompletionRequest


def template_kwargs(body: ChatCompletionRequest, tokenizer: Tokenizer, constrained: bool) -> dict[str, Any]:
    """The keywords of the request's prompt (Tokenizer.encode_chat's); APIError 400 naming the field at fault."""
    kwargs = dict(body.chat_template_kwargs or {})
    if tokenizer.chat_format != "kimi_k3":
        if body.reasoning_effort is not None:
            raise bad_request("reasoning_effort is a Kimi K3 setting: this model's chat format (Kimi K2) has no "
                              "thinking effort", "reasoning_effort")
        if kwargs and tokenizer.chat_template in (None, KIMI_CHAT_TEMPLATE):
            raise bad_request(f"the Kimi K2 chat template reads no chat_template_kwargs, got "
                              f"{', '.join(sorted(kwargs))}", "chat_template_kwargs")
        return kwargs
    unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
    if unknown:
        raise bad_request(f"Kimi K3's chat format reads chat_template_kwargs {', '.join(TEMPLATE_KWARGS)}, not "
                          f"{', '.join(unknown)}", "chat_template_kwargs")
    if "enable_thinking" in kwargs:
        kwargs.setdefault("thinking", kwargs.pop("enable_thinking"))
    if "thinking" in kwargs and not isinstance(kwargs["thinking"], bool):
        raise bad_request(f"chat_template_kwargs.thinking must be true or false, got {kwargs['thinking']!r}",
                          "chat_template_kwargs")
    effort = body.reasoning_effort
    if effort == "none":
        kwargs.setdefault("thinking", False)
    elif effort is not None:
        kwargs.setdefault("thinking_effort", effort)
    if kwargs.get("thinking_effort") is not None and kwargs["thinking_effort"] not in THINKING_EFFORTS:
        param = "reasoning_effort" if effort is not None and effort != "none" else "chat_template_kwargs"
        raise bad_request(f"Kimi K3 supports reasoning_effort {', '.join(THINKING_EFFORTS)} or none, got "
                          f"{kwargs['thinking_effort']!r}", param)
    if constrained:
        _check_unconstrained_thinking(kwargs)
        kwargs["thinking"] = False
    if body.tool_choice in ("required", "none"):
        kwargs["tool_choice"] = body.tool_choice
    if body.response_format is not None:
        kwargs["response_format"] = body.response_format.model_dump(by_alias=True, exclude_none=True)
    return kwargs


def _check_unconstrained_thinking(kwargs: dict[str, Any]) -> None:
    if kwargs.get("thinking") is True or kwargs.get("thinking_effort") is not None:
        raise bad_request("k3serve serves structured outputs and forced tool choices without thinking on Kimi K3 "
                       "(the constraint covers the whole output): leave thinking and reasoning_effort out, or set "
                       'reasoning_effort "none"', "reasoning_effort")
