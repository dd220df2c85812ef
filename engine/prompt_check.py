"""What a request must be before it costs any work: one check for the engine (`LLMEngine.add_request`,
and a decode engine's adopted request) and the disaggregated ingress (before its admission queue), so
both refuse the same requests with the same words (answered 400 by the API)."""

from __future__ import annotations

from typing import Sequence

from k3serve.engine.sampling_params import SamplingParams


def check_prompt(token_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """ValueError for a prompt the model cannot serve: empty, ids outside the vocabulary (logit_bias
    keys too), or no room left to generate."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    biased_outside = sorted(t for t in params.logit_bias or () if t >= vocab_size)
    if biased_outside:
        raise ValueError(f"logit_bias must use token ids in the vocabulary [0, {vocab_size}), got {biased_outside[:5]}")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens; "
                         f"max_model_len={max_model_len} leaves no room to generate")
    if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len={max_model_len}"
        )
