"""`speculative_config`: vLLM's fields, validated once, with messages that name the field.

Accepted as a `SpeculativeConfig`, a dict (YAML, `LLM(..., speculative_config={...})`) or its JSON text (the
`--speculative-config '<json>'` flag); `SpeculativeConfig.parse` is the one conversion.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from k3serve.model.packaged import packaged_drafter_dir

SpecMethod = Literal["ngram", "draft_model", "eagle", "dspark"]
SPEC_METHODS = ("ngram", "draft_model", "eagle", "dspark")
MAX_SPECULATIVE_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod
    """How drafts are proposed: prompt lookup (`ngram`) or a drafter checkpoint (`draft_model`, `eagle`, `dspark`)."""
    num_speculative_tokens: int
    """K: drafts proposed a step, 1..8."""
    model: str | None = None
    """The drafter's checkpoint directory, or a shipped drafter's name (`k3-code-eagle`), for the model-based
    methods only."""
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"
    """How a drafter samples its drafts (ngram drafts are deterministic)."""
    rejection_sample_method: Literal["standard"] = "standard"
    """The rejection sampler: `standard` (accept d with probability min(1, p(d)/q(d)))."""
    prompt_lookup_min: int = 1
    """ngram: the shortest suffix n-gram looked up."""
    prompt_lookup_max: int = 4
    """ngram: the longest suffix n-gram looked up (the longest match wins)."""

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if type(k) is not int or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError("speculative_config.draft_sample_method must be 'greedy' or 'probabilistic', "
                             f"got {self.draft_sample_method!r}")
        if self.rejection_sample_method != "standard":
            raise ValueError("speculative_config.rejection_sample_method must be 'standard', "
                             f"got {self.rejection_sample_method!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config.model={self.model!r} is for the model-based methods; "
                             "method 'ngram' needs no drafter")
        if self.method != "ngram" and not self.model:
            raise ValueError(f"speculative_config.model must name the drafter's checkpoint directory for "
                             f"method {self.method!r}")

    @property
    def model_dir(self) -> Path | None:
        """The drafter's checkpoint directory: the shipped one `model` names (`model/packaged.py`), else `model`."""
        if self.model is None:
            return None
        return packaged_drafter_dir(self.model) or Path(self.model)

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str") -> "SpeculativeConfig":
        """A config from itself, a dict of its fields, or that dict's JSON text; ValueError naming the field."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e.msg} at {e.pos}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config.{name} is required")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """Pydantic (`cluster/config.py`'s generated engine options) takes what `parse` takes and dumps the dict."""
        from pydantic_core import core_schema

        return core_schema.no_info_plain_validator_function(
            cls.parse, serialization=core_schema.plain_serializer_function_ser_schema(lambda c: c.to_dict()))
