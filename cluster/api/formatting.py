"""RequestDelta -> OpenAI chunks and responses: a formatter per choice, `Choices` for the whole request.

A formatter sees every delta of one choice (one engine request) in order. Streaming sends what
`chunks(delta)` returns; non-streaming feeds all deltas through the same formatter and asks for its
`choice()`, so both modes produce the same text, logprobs and finish reason. `Choices` holds the
formatters of one request in index order and builds what spans them: the response and the usage.

A chat choice of a request with tools holds its own tool-call stream (parsers.py: K2's tool_calls.py, or K3's
xtml.py, which also unwraps K3's response channel without tools): its text,
detokenized with the special tokens kept, is split into content and tool calls, streamed as
`delta.tool_calls` pieces or folded into `message.tool_calls`; a choice that made calls and stopped
finishes with "tool_calls" (the engine's reason stays in `finish_reason` for the metrics). A chat choice of a forced
tool choice holds a `ForcedCallStream` instead (forced_tool_choice.py): its whole text is JSON, read back as calls.

A chat choice served with a reasoning parser holds its stream (parsers.py: Kimi K2's reasoning.py or K3's xtml.py)
that reads its text first: the reasoning goes to `reasoning` and `reasoning_content` (message or delta), the rest
on as content, through the tool-call parser when there is one. The text is lexed once, by the first parser
(special_tokens.py). Both modes feed the parsers delta by delta in `add`, so they split the text alike.

Logprobs come as `TokenLogprobs` (chosen token first, then the top-n). Completions show them as
`{tokens, token_logprobs, top_logprobs: [{token: logprob}] (chosen + top-n), text_offset}`;
chat as `{content: [{token, logprob, bytes, top_logprobs: [top-n]}]}`.
"""

from __future__ import annotations

from typing import Iterator, Union

from k3serve.engine.outputs import RequestDelta, TokenLogprobs
from k3serve.model.tokenizer import Tokenizer

from .forced_tool_choice import ForcedCallStream
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprob,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from .parsers import ReasoningParser, ToolCallParser
from .special_tokens import SpecialTokenReader
from .tool_calls import ParsedDelta

Chunk = Union[CompletionStreamResponse, ChatCompletionStreamResponse]


def token_text(raw: bytes) -> str:
    """A token's bytes as text; a token that is not whole UTF-8 reads "bytes:\\xe4\\xbd" (OpenAI's form), so two
    different partial tokens never share a key in `top_logprobs`."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class _Formatter:
    response_type: type[CompletionResponse | ChatCompletionResponse]
    chunk_type: type[Chunk]

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, continuous_usage: bool = False,
                 index: int = 0) -> None:
        self.request_id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.continuous_usage = continuous_usage
        self.index = index  # the choice's index in the response
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0  # of the prompt, by the prefix cache

    def _track(self, delta: RequestDelta) -> None:
        self.text_parts.append(delta.new_text)
        self.num_prompt_tokens, self.num_output_tokens = delta.num_prompt_tokens, delta.num_output_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def _chunk(self, choice: CompletionChoice | ChatStreamChoice) -> Chunk:
        """A chunk of this choice; with continuous usage, the choice's own usage so far (as vLLM)."""
        usage = (UsageInfo.of(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)
                 if self.continuous_usage else None)
        return self.chunk_type(id=self.request_id, model=self.model, choices=[choice], usage=usage)

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.convert_ids_to_bytes([token_id])[0]

    def token_text(self, token_id: int) -> str:
        return token_text(self.token_bytes(token_id))


class CompletionFormatter(_Formatter):
    """One choice of a completion. With `echo_prompt` (its prompt's token ids; `echo`), the first delta's text and
    logprobs are preceded by the prompt's: its text, and with logprobs its tokens' (the first has none: null, as in
    OpenAI's and vLLM's echo)."""

    response_type, chunk_type = CompletionResponse, CompletionStreamResponse

    def __init__(self, *args, echo_prompt: list[int] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.logprobs: CompletionLogprobs | None = None
        self.num_chars = 0  # text_offset of the next token
        self.echo_prompt = echo_prompt

    def _append(self, out: CompletionLogprobs, token_id: int, entry: TokenLogprobs | None) -> None:
        """One position: the token, its logprob and its top-n by text (None for an echoed prompt's first token)."""
        out.tokens.append(self.token_text(token_id))
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            top: dict[str, float] = {}
            for tid, lp in zip(entry.token_ids, entry.logprobs):
                top.setdefault(self.token_text(tid), lp)
            out.token_logprobs.append(entry.chosen_logprob)
            out.top_logprobs.append(top)
        out.text_offset.append(self.num_chars)
        self.num_chars += len(out.tokens[-1])

    def _logprobs(self, delta: RequestDelta, echoed: list[TokenLogprobs | None] | None) -> CompletionLogprobs | None:
        if delta.logprobs is None:
            return None
        out = CompletionLogprobs()
        if echoed is not None:
            for token_id, entry in zip(self.echo_prompt, echoed, strict=True):
                self._append(out, token_id, entry)
        for entry in delta.logprobs:
            self._append(out, entry.token_ids[0], entry)
        return out

    def _echo(self, delta: RequestDelta) -> tuple[str, list[TokenLogprobs | None] | None]:
        """The prompt's text and logprobs to put before this delta's: on the first delta of an echo, else nothing."""
        if self.echo_prompt is None or self.text_parts:
            return "", None
        text = self.tokenizer.decode(self.echo_prompt, skip_special_tokens=False)
        if delta.logprobs is None:
            return text, None
        if delta.prompt_logprobs is None or len(delta.prompt_logprobs) != len(self.echo_prompt):
            raise RuntimeError(f"echo with logprobs: the engine returned prompt logprobs for "
                               f"{len(delta.prompt_logprobs or [])} of {len(self.echo_prompt)} prompt tokens")
        return text, delta.prompt_logprobs

    def add(self, delta: RequestDelta) -> tuple[str, CompletionLogprobs | None]:
        """Take one delta into the response; returns its text (the echoed prompt's before it on the first) and its
        own logprobs (None if not asked)."""
        echo_text, echoed = self._echo(delta)
        self._track(delta)
        self.text_parts[-1] = echo_text + self.text_parts[-1]
        logprobs = self._logprobs(delta, echoed)
        if logprobs is not None:
            self._extend(logprobs)
        return self.text_parts[-1], logprobs

    def chunks(self, delta: RequestDelta) -> list[CompletionStreamResponse]:
        text, logprobs = self.add(delta)
        if not (text or delta.finished or logprobs is not None):
            return []  # nothing to show yet (partial UTF-8, held-back stop prefix)
        return [self._chunk(CompletionChoice(index=self.index, text=text, logprobs=logprobs,
                                             finish_reason=delta.finish_reason, stop_reason=delta.stop_reason))]

    def _extend(self, logprobs: CompletionLogprobs) -> None:
        if self.logprobs is None:
            self.logprobs = CompletionLogprobs()
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.logprobs, name).extend(getattr(logprobs, name))

    def choice(self) -> CompletionChoice:
        """The whole choice, after its last delta."""
        return CompletionChoice(index=self.index, text="".join(self.text_parts), logprobs=self.logprobs,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class ChatFormatter(_Formatter):
    """One choice of a chat completion; with `reasoning`, its text is split into reasoning and content; with
    `tool_calls` (a new parser for the choice), the content is parsed for Kimi's tool calls; with `forced_calls`, the
    text is the calls."""

    response_type, chunk_type = ChatCompletionResponse, ChatCompletionStreamResponse

    def __init__(self, *args, top_logprobs: int = 0, tool_calls: ToolCallParser | None = None,
                 reasoning: ReasoningParser | None = None, forced_calls: ForcedCallStream | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.top_logprobs = top_logprobs
        self.logprobs: list[ChatLogprob] | None = None
        self.tool_parser = tool_calls
        self.forced_calls = forced_calls
        self.reasoning_parser = reasoning
        # without a reasoning parser to lex the text for it, the tool-call parser's own reader
        lexed_for_it = tool_calls is None or reasoning is not None
        self._reader = None if lexed_for_it else SpecialTokenReader(self.tokenizer.special_tokens)
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []  # the text less the reasoning (and the tool calls)

    def _entry(self, entry: TokenLogprobs) -> ChatLogprob:
        def top(tid: int, lp: float) -> TopLogprob:
            return TopLogprob(token=self.token_text(tid), logprob=lp, bytes=list(self.token_bytes(tid)))

        first = top(entry.token_ids[0], entry.logprobs[0])
        ranked = zip(entry.token_ids[1 : 1 + self.top_logprobs], entry.logprobs[1 : 1 + self.top_logprobs])
        return ChatLogprob(**first.model_dump(), top_logprobs=[top(t, lp) for t, lp in ranked])

    def role_chunk(self) -> ChatCompletionStreamResponse:
        """The choice's first chunk, before any delta: role "assistant", empty content."""
        return self._chunk(ChatStreamChoice(index=self.index, delta=DeltaMessage(role="assistant", content="")))

    def add(self, delta: RequestDelta) -> tuple[str, ParsedDelta, ChatLogprobs | None]:
        """Take one delta into the response; returns its text split into reasoning, and content and tool-call
        pieces, and its own logprobs (None if not asked)."""
        self._track(delta)
        reasoning, parsed = self._parse(delta.new_text, delta.finished)
        self.reasoning_parts.append(reasoning)
        self.content_parts.append(parsed.content)
        if delta.logprobs is None:
            return reasoning, parsed, None
        logprobs = ChatLogprobs(content=[self._entry(e) for e in delta.logprobs])
        if self.logprobs is None:
            self.logprobs = []
        self.logprobs.extend(logprobs.content)  # in place: a copy a delta was quadratic in the output
        return reasoning, parsed, logprobs

    def _parse(self, text: str, finished: bool) -> tuple[str, ParsedDelta]:
        """A delta's text through the parsers: its reasoning, and its content and tool-call pieces."""
        if self.forced_calls is not None:
            parsed = self.forced_calls.read(text)
            parsed.content += self.forced_calls.finish() if finished else ""
            return "", parsed
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.feed(text)
            if finished:
                rest = self.reasoning_parser.finish()
                split.reasoning, split.held_back = split.reasoning + rest.reasoning, rest.held_back
            if self.tool_parser is None:
                return split.reasoning, ParsedDelta(content=split.content_text)
            reasoning, pieces, held_back = split.reasoning, split.content, split.held_back
        elif self.tool_parser is not None:
            reasoning, pieces = "", self._reader.feed(text)
            held_back = self._reader.finish() if finished else ""
        else:
            return "", ParsedDelta(content=text)
        parsed = self.tool_parser.read(pieces)
        if finished:
            parsed.content += self.tool_parser.finish(held_back).content
        return reasoning, parsed

    def chunks(self, delta: RequestDelta) -> list[ChatCompletionStreamResponse]:
        reasoning, parsed, logprobs = self.add(delta)
        message = DeltaMessage(reasoning=reasoning or None, reasoning_content=reasoning or None,
                               content=parsed.content or None,
                               tool_calls=_delta_tool_calls(parsed) or None)
        if message == DeltaMessage() and not delta.finished and logprobs is None:
            return []  # nothing to show yet (partial UTF-8, held-back stop prefix or marker)
        return [self._chunk(ChatStreamChoice(index=self.index, delta=message, logprobs=logprobs,
                                             finish_reason=self._shown_reason(delta.finish_reason),
                                             stop_reason=delta.stop_reason))]

    def _shown_reason(self, finish_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for a turn that made calls and stopped (not one cut by max_tokens); the same in both
        modes, as it is read from the parser after the last delta. A Kimi turn made calls once one was completed (a
        call it broke off inside is not one); a forced one, as its stream says."""
        if self.tool_parser is not None:
            called = self.tool_parser.num_complete > 0
        else:
            called = self.forced_calls is not None and self.forced_calls.shows_tool_calls
        return "tool_calls" if called and finish_reason == "stop" else finish_reason

    def choice(self) -> ChatChoice:
        """The whole choice, after its last delta."""
        reasoning, text, calls = "".join(self.reasoning_parts), "".join(self.content_parts), []
        parser = self.tool_parser or self.forced_calls
        if parser is not None:
            text, parsed = parser.result()
            calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed]
        content = text if text or not (reasoning or calls) else None  # "" only for a turn that wrote nothing at all
        message = AssistantMessage(reasoning=reasoning or None, reasoning_content=reasoning or None, content=content,
                                   tool_calls=calls or None)
        return ChatChoice(index=self.index, message=message,
                          logprobs=None if self.logprobs is None else ChatLogprobs(content=self.logprobs),
                          finish_reason=self._shown_reason(self.finish_reason), stop_reason=self.stop_reason)


def _delta_tool_calls(parsed: ParsedDelta) -> list[DeltaToolCall]:
    """The parser's pieces on the wire: a call's first piece carries its id, type and name (arguments "" at least,
    as OpenAI sends them), the others their argument text only."""
    return [DeltaToolCall(index=piece.index, id=piece.id, type=None if piece.id is None else "function",
                          function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))
            for piece in parsed.calls]


Formatter = Union[CompletionFormatter, ChatFormatter]


class Choices:
    """The formatters of one request's choices, in index order: choice `prompt * n + j` is the j-th sample of the
    request's prompt `prompt` (vLLM's order for a batch of prompts)."""

    def __init__(self, formatters: list[Formatter], n: int) -> None:
        self.formatters = formatters
        self.n = n

    def __getitem__(self, index: int) -> Formatter:
        return self.formatters[index]

    def __iter__(self) -> Iterator[Formatter]:
        return iter(self.formatters)

    def prompt_of(self, index: int) -> int:
        return index // self.n

    @property
    def usage(self) -> UsageInfo:
        """Each prompt's tokens once, however many choices it has (OpenAI bills a prompt once; vLLM counts so); the
        completion tokens of every choice. Cached tokens: each prompt's first choice's hit, as its prompt tokens."""
        firsts = self.formatters[:: self.n]
        return UsageInfo.of(sum(f.num_prompt_tokens for f in firsts), sum(f.num_output_tokens for f in self.formatters),
                            sum(f.num_cached_tokens for f in firsts))

    @property
    def finish_reason(self) -> str | None:
        """The first choice's: the request counters count a request once, by one reason."""
        return self.formatters[0].finish_reason

    def response(self) -> CompletionResponse | ChatCompletionResponse:
        first = self.formatters[0]
        return first.response_type(id=first.request_id, model=first.model,
                                   choices=[f.choice() for f in self.formatters], usage=self.usage)

    def usage_chunk(self) -> Chunk:
        """The last chunk before [DONE] (include_usage): no choice, the whole request's usage."""
        first = self.formatters[0]
        return first.chunk_type(id=first.request_id, model=first.model, choices=[], usage=self.usage)
