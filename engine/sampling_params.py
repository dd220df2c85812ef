"""Per-request sampling settings, shaped like vLLM's `SamplingParams` so outside tools work.

Validated once in `__post_init__` (every error quotes the bad value); the sampler, detokenizer
and scheduler trust the fields afterwards. After construction:

- `stop` is always a list of non-empty strings and `stop_token_ids` always a list of ints;
- `logit_bias` is None or a non-empty dict of int token id -> float bias;
- `top_k == 0` means "off" (`-1` is accepted as vLLM's old spelling and stored as 0);
- a greedy request (`is_greedy`) has `top_p == 1`, `top_k == 0` and `min_p == 0`, as in vLLM.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# Temperatures below this are treated as greedy (vLLM's `_SAMPLING_EPS`).
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match, as vLLM's `StructuredOutputsParams`: exactly one of a JSON schema
    (`json`, the schema's text; a dict is serialized), any JSON object (`json_object`), a regular expression
    (`regex`), one of a list of strings (`choice`) or an EBNF grammar (`grammar`). Checked here for shape only;
    whether the schema, regex or grammar compiles is the engine's question (its error becomes a 400)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))  # the schema's key order is the output's
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) \
                    or not self.choice:
                raise ValueError(f"structured output choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured output {name} must be a non-empty string, got {value!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured output json_object must be a bool, got {self.json_object!r}")
        kinds = self._kinds()
        if len(kinds) != 1:
            raise ValueError(f"structured outputs need exactly one of json, json_object, regex, choice, grammar; "
                             f"got {kinds or 'none'}")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        return self._kinds()[0]

    def _kinds(self) -> list[str]:
        """The constraints set (exactly one once constructed)."""
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        return kinds + ["json_object"] if self.json_object else kinds


@dataclass
class SamplingParams:
    """How to sample one request. Field names and defaults follow vLLM."""

    n: int = 1
    """Number of sequences per request. Only 1 is supported."""
    temperature: float = 1.0
    """Logits are divided by this; below 1e-5 the request is greedy (argmax)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability mass reaches top_p; in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) turns it off."""
    min_p: float = 0.0
    """Drop tokens with probability below min_p * (max probability); in [0, 1]."""
    seed: int | None = None
    """Seed for this request's own generator; the same seed gives the same tokens in any batch."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of every token in the output; in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Tokens in prompt or output: positive logits divided by it, negative multiplied; > 0."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None means up to the model's length limit."""
    min_tokens: int = 0
    """EOS and stop_token_ids are banned until this many tokens have been generated."""
    stop: str | list[str] | None = None
    """Strings that end generation; normalized to a list. Not included in the text by default."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (besides EOS); normalized to a list."""
    ignore_eos: bool = False
    """Keep generating after EOS."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top logprobs per generated token."""
    prompt_logprobs: int | None = None
    """Return the actual token's logprob plus this many top logprobs per prompt position."""
    skip_special_tokens: bool = True
    """Special tokens produce no output text."""
    keep_special_token_ids: list[int] | None = None
    """Special tokens that still produce text when skip_special_tokens (the chat API's tool-call and reasoning
    markers, which its parsers read and never show); normalized to a list."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias in [-100, 100], added to that token's logit before penalties and temperature (OpenAI's
    `logit_bias`); the ids must be in the model's vocabulary (the engine checks). Logprobs stay raw: unbiased."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrains the output to a JSON schema, any JSON object, a regex, a choice or a grammar (the engine masks
    every token the constraint does not allow before min_tokens, logit_bias, penalties and temperature, as vLLM v1
    does; logprobs stay raw, unmasked)."""

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n must be 1 (k3serve samples one sequence per request), got n={self.n!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got temperature={self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got top_p={self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 to disable, got top_k={self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got min_p={self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got seed={self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {name}={value!r}")
        if not self.repetition_penalty > 0.0 or not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be finite and > 0, got repetition_penalty={self.repetition_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got max_tokens={self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got min_tokens={self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens!r}, max_tokens={self.max_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {name}={value!r}")
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_token_ids(self.stop_token_ids, "stop_token_ids")
        self.keep_special_token_ids = _normalize_token_ids(self.keep_special_token_ids, "keep_special_token_ids")
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, "
                             f"got {self.structured_outputs!r}")
        if self.is_greedy:  # as vLLM: filtering is meaningless for argmax
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax (temperature below 1e-5, as vLLM)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        """True when any of presence, frequency or repetition penalty is not neutral."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _normalize_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    stop = list(stop)
    for s in stop:
        if not isinstance(s, str) or s == "":
            raise ValueError(f"stop strings must be non-empty str, got {s!r} in stop={stop!r}")
    return stop


def _normalize_token_ids(ids: list[int] | None, name: str) -> list[int]:
    if ids is None:
        return []
    ids = list(ids)
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError(f"{name} must be ints >= 0, got {i!r} in {name}={ids!r}")
    return ids


def _normalize_logit_bias(bias: dict[int, float] | None) -> dict[int, float] | None:
    """None for no bias (an empty dict too); else a copy with float values. An error names the bad entry alone:
    a bias map can hold thousands of them."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias or None, got logit_bias={bias!r}")
    for token_id, value in bias.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"logit_bias must have int token ids >= 0 as keys, got key {token_id!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:  # NaN too
            raise ValueError(f"logit_bias must have values in [-100, 100], got {value!r} for token {token_id}")
    return {token_id: float(value) for token_id, value in bias.items()} or None
