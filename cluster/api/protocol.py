"""Wire types of the OpenAI routes, as pydantic v2 models.

Requests accept fields they do not know (OpenAI clients send extras such as `user`, `metadata`
or `store`): those change nothing in the answer, so they are ignored and
logged at debug level. The extras that would change it, features k3serve does not implement
(the deprecated `functions`, tools on /v1/completions, suffix, best_of, chat echo), are refused
with a 400 naming the field unless their value asks for nothing (`NOT_IMPLEMENTED`, the one table
of them): answering 200 with something other than what was asked would be silently wrong. Range checks that the OpenAI API states live here; everything
`SamplingParams` validates is left to it (its ValueError becomes a 400). Every string of a request, at any depth,
must be valid Unicode: a lone surrogate is a 400 naming its path (unicode_check.py).

Chat takes OpenAI's `tools` (functions only; a wrong shape is a 400 naming `tools`) with
`tool_choice` "auto" (the default), "none", "required" or a named function (the last two force calls:
forced_tool_choice.py), and the turns that follow a call: assistant messages with `tool_calls`, `tool`
messages answering one by its `tool_call_id`. The calls the model makes come back as `message.tool_calls`
(tool_calls.py parses them from Kimi's format). A tool_choice other than "none" without tools is a 400 naming
`tool_choice`, as vLLM answers it. `parallel_tool_calls: false` allows one call a turn, as vLLM serves it: "required"
constrains the output to one, "auto" returns the first call the model makes and drops the others.

Both routes take structured output: OpenAI's `response_format` and vLLM's `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` and `structured_outputs`; structured_outputs.py maps them onto the engine's one
constraint.

Responses and stream chunks are shaped exactly like OpenAI's; `stop_reason` (the stop string or
token id that ended a choice) and `reasoning` (a thinking model's reasoning, present only when
it wrote some; also as `reasoning_content`, its older name) are vLLM's extensions. In chunks,
`usage` appears only when set and `delta` holds only the keys that changed.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from .unicode_check import find_lone_surrogate

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # top logprobs per token, at most (vLLM's default max_logprobs)
MAX_CHOICES = 64
"""Choices a request asks for, at most: `n`, and for a batch of prompts `n` times their number. Each choice is one
engine request; 64 is an engine's default `max_num_seqs`, so that one request at the cap can run whole on an idle
replica (vLLM has no cap; OpenAI's `n` goes to 128)."""


# ---- what is refused ---------------------------------------------------------------------------
def _asks_nothing(value: Any) -> bool:
    return value is None or value is False or value in ("", [], {})


def _one_of(*harmless: str) -> Callable[[Any], bool]:
    return lambda value: value is None or (isinstance(value, str) and value in harmless)


_NO_TOOLS = "k3serve serves tool calling on /v1/chat/completions with `tools` only"

NOT_IMPLEMENTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # field (where the route does not implement it): (the values that ask for nothing, why the others are refused)
    "tools": (_asks_nothing, _NO_TOOLS),
    "functions": (_asks_nothing, _NO_TOOLS),
    "tool_choice": (_one_of("none", "auto"), f'{_NO_TOOLS}; only "none" or "auto" is accepted'),
    "function_call": (_one_of("none", "auto"), f'{_NO_TOOLS}; only "none" or "auto" is accepted'),
    "guided_whitespace_pattern": (_asks_nothing, "k3serve does not implement a custom whitespace pattern in "
                                                 "structured output"),
    "suffix": (_asks_nothing, "k3serve does not implement insertion (text after the completion)"),
    "best_of": (lambda value: value is None or value == 1, "must be 1: k3serve samples one sequence per request"),
    # OpenAI's chat has no echo; vLLM's (the last message's content before the reply when the roles match) is not
    # implemented. /v1/completions declares its own echo, so this applies to chat only.
    "echo": (_asks_nothing, "k3serve does not implement echo on chat completions (/v1/completions has it)"),
}


def _field_error(model: type[BaseModel], field: str | tuple[str | int, ...], message: str,
                 value: Any) -> ValidationError:
    """A validation error located at `field` (a name, or a path into the body), raised from a model validator: the
    400 then names the field as its `param` (a plain ValueError there is located at the whole body)."""
    error = PydanticCustomError("invalid_field", "{message}", {"message": message})
    loc = (field,) if isinstance(field, str) else field
    return ValidationError.from_exception_data(model.__name__, [InitErrorDetails(type=error, loc=loc, input=value)])


# ---- requests ---------------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown(self) -> "_Request":
        if self.model_extra:
            logger.debug("%s: ignoring unknown fields %s", type(self).__name__, sorted(self.model_extra))
        return self


class StreamOptions(_Request):
    include_usage: bool = False
    """Send a last chunk with the request's usage (and `choices: []`) before [DONE]."""
    continuous_usage_stats: bool = False
    """Put the usage so far on every chunk (vLLM's extension; guidellm asks for it)."""


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the output must be JSON that validates against `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)  # a misspelt key would drop the schema
    name: str = Field(min_length=1)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    """The JSON Schema (OpenAI's key is `schema`, which pydantic's BaseModel keeps for itself)."""
    strict: bool | None = None
    """Accepted; the schema is always enforced, as vLLM does."""


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object) or "json_schema" (with
    its `json_schema`)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a `json_schema` object with `name` and `schema`')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f'`json_schema` is only allowed with type "json_schema", not {self.type!r}')
        return self


class _SamplingFields(_Request):
    """Fields both routes share, and the refusal of the `NOT_IMPLEMENTED` extras."""

    model: str | None = None
    """Served model id; another id answers 404. Optional (a single-model server)."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (a decimal string, as JSON keys are) -> bias in [-100, 100] added to its logit."""
    n: int = 1
    """Choices for the prompt (each prompt of a batch), in [1, MAX_CHOICES]: one engine request each. With a seed,
    choice j samples with seed + j (vLLM's rule): the choices differ, and the same seed gives the same choices."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured output, at most one of them asking for a constraint (structured_outputs.py).
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    """vLLM's extra: a JSON schema, as an object or its text."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    """An EBNF grammar (xgrammar's dialect, as vLLM's default backend reads it)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's newer extra: {"json" | "json_object" | "regex" | "choice" | "grammar": ...}, one key."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        """Every string of the body, at any depth (messages, prompt, stop, tools, schemas, keys), is valid Unicode:
        a lone surrogate is a 400 naming its path (unicode_check.py)."""
        found = find_lone_surrogate(data)
        if found is not None:
            raise _field_error(cls, found.loc, found.message(), None)
        return data

    @model_validator(mode="after")
    def _check_shared(self) -> "_SamplingFields":
        if not 1 <= self.n <= MAX_CHOICES:
            raise _field_error(type(self), "n", f"must be in [1, {MAX_CHOICES}], got {self.n}", self.n)
        if self.stream_options is not None and not self.stream:
            raise _field_error(type(self), "stream_options", "is only allowed when stream is true", None)
        for name, value in (self.model_extra or {}).items():
            harmless, why = NOT_IMPLEMENTED.get(name, (None, ""))
            if harmless is not None and not harmless(value):
                raise _field_error(type(self), name, why, value)
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    """Text or token ids, or a batch: a list of texts or of token-id lists. Each prompt gets `n` choices, choice
    `prompt_index * n + j` its j-th (vLLM's order); `n` times the number of prompts is at most MAX_CHOICES."""
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Logprob of each sampled token plus this many top alternatives."""
    echo: bool = False
    """The prompt's text before the completion; with logprobs, the prompt tokens' logprobs too (the first None)."""


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key would silently leave the model without it
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON Schema of the arguments."""
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the function the model must call: {"type": "function", "function": {"name": ...}}."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """JSON text, as the model wrote it (not validated, as OpenAI's)."""


class ToolCall(BaseModel):
    """A call the assistant made: in a response, and in the assistant messages of a later turn."""

    id: str
    """Kimi's own id, `functions.<name>:<index>`; the chat template renders it back as it is."""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, ...
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    """The calls of an assistant turn."""
    tool_call_id: str | None = None
    """The call a `tool` message answers."""

    @model_validator(mode="after")
    def _check_tool_fields(self) -> "ChatMessage":
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message with role 'tool' needs the tool_call_id of the call it answers")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages have tool_calls, not role {self.role!r}")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """Wins over max_tokens (OpenAI's newer name)."""
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    """Functions the model may call, as `tool_choice` says."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """"auto" (None too) lets the model call `tools`, "none" hides them from it; "required" (at least one call of
    any of them) and a named function (one call of it) force calls, as a constraint on the output."""
    parallel_tool_calls: bool | None = None
    """False: at most one call a turn. True or None (OpenAI's default): as many as the model makes."""
    reasoning_effort: str | None = None
    """Kimi K3: "low", "high" or "max" thinking, "none" no thinking (template_kwargs.py); a 400 on Kimi K2."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: keywords of the chat prompt, e.g. {"thinking": false} on Kimi K3 (template_kwargs.py); a keyword
    the model's chat format does not read is a 400."""

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise _field_error(type(self), "top_logprobs", "needs logprobs set to true", self.top_logprobs)
        choice = self.tool_choice
        names = [tool.function.name for tool in self.tools or []]
        if choice not in (None, "none") and not names:  # vLLM's 400 too
            shown = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
            raise _field_error(type(self), "tool_choice", f"{shown!r} needs `tools`: the functions the model may call "
                               '(without them, leave tool_choice out or send "none")', shown)
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _field_error(type(self), "tool_choice", f"names the function {choice.function.name!r}, which is "
                               f"not among `tools` ({', '.join(names)})", choice.model_dump())
        return self

    @property
    def max_tool_calls(self) -> int | None:
        """1 with parallel_tool_calls false, else None: no limit."""
        return 1 if self.parallel_tool_calls is False else None

    @property
    def forces_tool_calls(self) -> bool:
        """tool_choice "required" or a named function: the output is the calls."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def active_tools(self) -> list[dict[str, Any]] | None:
        """The tools to render into the prompt and to parse calls of, as the client sent them; None without tools
        or with tool_choice "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses --------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens served by a prefix-cache hit (OpenAI's and vLLM's field)."""


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> "UsageInfo":
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_output_tokens,
                   total_tokens=num_prompt_tokens + num_output_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


class _OmitNone(BaseModel):
    """Serialized without those of its `omit_none` fields that are None (every field when `omit_none` is None)."""

    omit_none: ClassVar[tuple[str, ...] | None] = None

    @model_serializer(mode="wrap")
    def _omit(self, handler: Any) -> dict[str, Any]:
        omit = self.omit_none
        return {k: v for k, v in handler(self).items() if v is not None or (omit is not None and k not in omit)}


class _Chunk(_OmitNone):
    """A stream chunk: `usage` only when set."""

    omit_none = ("usage",)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_Chunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class AssistantMessage(_OmitNone):
    omit_none = ("reasoning", "reasoning_content", "tool_calls")
    role: Literal["assistant"] = "assistant"
    reasoning: str | None = None
    """What a thinking model wrote in its think block or channel (vLLM's field; reasoning.py, xtml.py)."""
    reasoning_content: str | None = None
    """`reasoning` under its older name, kept for the clients that read it."""
    content: str | None
    """None when the turn is reasoning or tool calls only."""
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(_OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitNone):
    """A piece of call `index`: id, type and name on its first piece (arguments ""), argument text after."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_OmitNone):
    role: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # `reasoning`, by its older name
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Chunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "k3serve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
