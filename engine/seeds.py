"""Seeded sampling is a pure function of (seed, output position): whichever engine samples a token (colocated, or
prefill then decode after a handoff, or another replica continuing a stream), the same seed gives the same text.
Plain integers, no torch: the ingress's stream migration uses `continuation_seed` too."""

from __future__ import annotations

_SEED_MIX = 0x9E3779B97F4A7C15  # odd: invertible modulo 2**63
_MODULUS = 1 << 63


def position_seed(seed: int, num_output_tokens: int) -> int:
    """The seed of the generator that draws a request's output token at position `num_output_tokens`."""
    return (seed * _SEED_MIX + num_output_tokens) % _MODULUS


def continuation_seed(seed: int, num_output_tokens: int) -> int:
    """The seed whose output position j draws what `seed` draws at position `num_output_tokens + j`: a
    request continued from its first `num_output_tokens` tokens (as its prompt) samples what it would have."""
    return (seed + num_output_tokens * pow(_SEED_MIX, -1, _MODULUS)) % _MODULUS
