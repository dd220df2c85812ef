"""RequestDelta -> OpenAI chunks and responses, one formatter per route.

A formatter sees every delta of one request in order. Streaming sends what `chunks(delta)`
returns; non-streaming feeds all deltas through the same formatter and asks for `response()`,
so both modes produce the same text, logprobs and finish reason.

Logprobs come as `TokenLogprobs` (chosen token first, then the top-n). Completions show them as
`{tokens, token_logprobs, top_logprobs: [{token: logprob}] (chosen + top-n), text_offset}`;
chat as `{content: [{token, logprob, bytes, top_logprobs: [top-n]}]}`.
"""

from __future__ import annotations

from k3serve.engine.outputs import RequestDelta, TokenLogprobs
from k3serve.model.tokenizer import Tokenizer

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
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)


class _Formatter:
    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, continuous_usage: bool = False) -> None:
        self.request_id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.continuous_usage = continuous_usage
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0

    def _track(self, delta: RequestDelta) -> None:
        self.text_parts.append(delta.new_text)
        self.num_prompt_tokens, self.num_output_tokens = delta.num_prompt_tokens, delta.num_output_tokens
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.num_prompt_tokens, self.num_output_tokens)

    def _chunk_usage(self) -> UsageInfo | None:
        return self.usage if self.continuous_usage else None

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.convert_ids_to_bytes([token_id])[0]

    def token_text(self, token_id: int) -> str:
        """The token as text; a token that is not whole UTF-8 reads "bytes:\\xe4\\xbd" (OpenAI's form),
        so two different partial tokens never share a key in `top_logprobs`."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class CompletionFormatter(_Formatter):
    """With `echo_prompt` (the prompt's token ids; `echo`), the first delta's text and logprobs are preceded by the
    prompt's: its text, and with logprobs its tokens' (the first has none: null, as in OpenAI's and vLLM's echo)."""

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
        choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=delta.finish_reason,
                                  stop_reason=delta.stop_reason)
        return [CompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice],
                                         usage=self._chunk_usage())]

    def usage_chunk(self) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.request_id, model=self.model, choices=[], usage=self.usage)

    def _extend(self, logprobs: CompletionLogprobs) -> None:
        if self.logprobs is None:
            self.logprobs = CompletionLogprobs()
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.logprobs, name).extend(getattr(logprobs, name))

    def response(self) -> CompletionResponse:
        choice = CompletionChoice(text="".join(self.text_parts), logprobs=self.logprobs,
                                  finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        return CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=self.usage)


class ChatFormatter(_Formatter):
    def __init__(self, *args, top_logprobs: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.top_logprobs = top_logprobs
        self.logprobs: list[ChatLogprob] | None = None

    def _entry(self, entry: TokenLogprobs) -> ChatLogprob:
        def top(tid: int, lp: float) -> TopLogprob:
            return TopLogprob(token=self.token_text(tid), logprob=lp, bytes=list(self.token_bytes(tid)))

        first = top(entry.token_ids[0], entry.logprobs[0])
        ranked = zip(entry.token_ids[1 : 1 + self.top_logprobs], entry.logprobs[1 : 1 + self.top_logprobs])
        return ChatLogprob(**first.model_dump(), top_logprobs=[top(t, lp) for t, lp in ranked])

    def role_chunk(self) -> ChatCompletionStreamResponse:
        """The first chunk: role "assistant", empty content."""
        choice = ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))
        return ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice],
                                            usage=UsageInfo.of(self.num_prompt_tokens, 0) if self.continuous_usage
                                            else None)

    def add(self, delta: RequestDelta) -> ChatLogprobs | None:
        """Take one delta into the response; returns its own logprobs (None if not asked)."""
        self._track(delta)
        if delta.logprobs is None:
            return None
        logprobs = ChatLogprobs(content=[self._entry(e) for e in delta.logprobs])
        self.logprobs = (self.logprobs or []) + logprobs.content
        return logprobs

    def chunks(self, delta: RequestDelta) -> list[ChatCompletionStreamResponse]:
        logprobs = self.add(delta)
        if not (delta.new_text or delta.finished or logprobs is not None):
            return []
        choice = ChatStreamChoice(delta=DeltaMessage(content=delta.new_text) if delta.new_text else DeltaMessage(),
                                  logprobs=logprobs, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
        return [ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice],
                                             usage=self._chunk_usage())]

    def usage_chunk(self) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[], usage=self.usage)

    def response(self) -> ChatCompletionResponse:
        choice = ChatChoice(message=AssistantMessage(content="".join(self.text_parts)),
                            logprobs=None if self.logprobs is None else ChatLogprobs(content=self.logprobs),
                            finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=self.usage)
