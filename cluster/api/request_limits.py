"""`RequestLimits`: the checks of a request's size that run on the event loop, before its prompt is rendered and
tokenized, each cheap (lengths only) and each naming what it bounds.

    stop            at most `max_stop_sequences` strings of at most `max_stop_sequence_chars` characters
    stop_token_ids  at most `max_stop_sequences` ids
    logit_bias      at most `max_logit_bias_entries` entries
    prompt text     a prompt that cannot fit the context is refused before it costs a tokenization:

A token stands for at most `max_token_bytes` bytes of text (the tokenizer's longest, special tokens included),
and a character is at least one byte, so text of more than `max_model_len x max_token_bytes` characters is more
than `max_model_len` tokens, whatever the tokenizer makes of it. The text counted is what the chat template
renders verbatim (message contents, tool call arguments) or a completion's text prompt (each of a batch); the
template's own markers only add tokens, so the bound stays a lower one. (A tokenizer that normalized text could
shrink it: k3serve's, byte-level BPE and tiktoken, do not.) The exact check of the context, in tokens, follows the
tokenization (serving.py).
"""

from __future__ import annotations

from k3serve.cluster.ingress_limits import IngressLimits
from k3serve.model.tokenizer import Tokenizer

from .errors import bad_request
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingFields


class RequestLimits:
    def __init__(self, limits: IngressLimits, tokenizer: Tokenizer, max_model_len: int) -> None:
        """Reads every token's bytes once (the tokenizer caches them: the detokenizer reads the same table)."""
        self.limits, self.max_model_len = limits, max_model_len
        self.max_token_bytes = max(map(len, tokenizer.convert_ids_to_bytes(range(tokenizer.vocab_size))))
        self.max_prompt_chars = max_model_len * self.max_token_bytes

    def check(self, body: _SamplingFields) -> None:
        """APIError 400 naming the field and the limit it exceeds."""
        self._check_stop(body.stop)
        ids, most = len(body.stop_token_ids or ()), self.limits.max_stop_sequences
        if ids > most:  # each generated token is looked up in the list
            raise bad_request(f"stop_token_ids has {ids} ids, more than max_stop_sequences ({most})", "stop_token_ids")
        entries, most = len(body.logit_bias or ()), self.limits.max_logit_bias_entries
        if entries > most:
            raise bad_request(f"logit_bias has {entries} entries, more than max_logit_bias_entries ({most})",
                              "logit_bias")
        if isinstance(body, ChatCompletionRequest):
            self._check_chars(sum(map(_rendered_chars, body.messages)), "messages")
        elif isinstance(body, CompletionRequest):
            texts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
            self._check_chars(max((len(t) for t in texts if isinstance(t, str)), default=0), "prompt")

    def _check_stop(self, stop: str | list[str] | None) -> None:
        stops = [stop] if isinstance(stop, str) else stop or []
        most, longest = self.limits.max_stop_sequences, self.limits.max_stop_sequence_chars
        if len(stops) > most:
            raise bad_request(f"stop has {len(stops)} strings, more than max_stop_sequences ({most})", "stop")
        too_long = next((i for i, s in enumerate(stops) if len(s) > longest), None)
        if too_long is not None:
            raise bad_request(f"stop string {too_long} has {len(stops[too_long])} characters, more than "
                              f"max_stop_sequence_chars ({longest})", "stop")

    def _check_chars(self, chars: int, what: str) -> None:
        if chars > self.max_prompt_chars:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your {what} ({chars} "
                f"characters) need more tokens than that: at most {self.max_prompt_chars} characters fit "
                f"(max_prompt_chars: max_model_len x {self.max_token_bytes} bytes, the longest token). "
                f"Please reduce the length of the {what}.", what)


def _rendered_chars(message: ChatMessage) -> int:
    """Characters of `message` that the chat template renders as they are: its content, its calls' arguments."""
    content = message.content
    if isinstance(content, str):
        chars = len(content)
    else:
        chars = sum(len(part.text or "") for part in content or ())
    return chars + sum(len(call.function.arguments) for call in message.tool_calls or ())
