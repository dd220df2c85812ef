"""Exact rejection sampling of a verify row's drafts against the target (the standard algorithm).

For drafts d_1..d_k drawn from q_i, p_i the target's sampling distribution at row i, `filtered_probs` as for a
non-speculative row (temperature, top-k, top-p, min-p): accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
at the first rejection emit a token of the residual max(p_i - q_i, 0), renormalised, and stop; when every draft
passes emit the bonus token from p_{k+1}. The emitted token at each position then has exactly the target's law.
Deterministic drafts (prompt lookup, a greedy drafter: `draft_probs` None) have q_i a point mass at d_i: accept
with probability p_i(d_i), the residual is p_i with d_i removed. `sample_draft` draws a probabilistic drafter's
token from its q. A greedy request accepts while d_i is the argmax of
row i (`torch.argmax`'s tie-break, as `Sampler.sample`) and emits the argmax at the first mismatch, or the bonus.

Seeded requests draw from counter-based streams keyed by (seed, output position, purpose): reproducible and
independent of the batch, though not the same sample as the seeded non-speculative path (the same law).
Unseeded ones draw from torch's global RNG. Host loop over a step's verify rows; engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.engine.sampler import exponential_noise, filtered_probs
from k3serve.engine.sampling_params import SamplingParams

_ACCEPT, _RECOVER, _BONUS, _DRAFT = 1, 2, 3, 4  # the purposes of a position's draws


def draw_stream(seed: int | None, position: int, purpose: int) -> torch.Generator | None:
    """The generator of one draw of a seeded request: a pure function of (seed, output position, purpose)."""
    if seed is None:
        return None
    key = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + purpose * 0x94D049BB133111EB) % (1 << 63)
    return torch.Generator().manual_seed(key)


@dataclass(frozen=True)
class Verdict:
    token_ids: list[int]  # [a + 1]: the a accepted drafts, then the recovered or bonus token
    num_accepted: int  # a, 0..k


def rejection_sample(logits: torch.Tensor, draft_ids: list[int], params: SamplingParams,
                     num_output_tokens: int, draft_probs: torch.Tensor | None = None) -> Verdict:
    """One verify row: `logits` [1 + k, V] fp32 (row i scores the token after draft i, row 0 the token after
    the last output), k = len(draft_ids) >= 1; `num_output_tokens` before this step (the first emitted token's
    output position, which keys a seeded request's draws); `draft_probs` [k, V]: the q each draft was drawn
    from, None for deterministic drafts (a greedy request ignores it)."""
    k = len(draft_ids)
    if logits.dim() != 2 or logits.shape[0] != k + 1 or k < 1:
        raise ValueError(f"logits must be [1 + k, V] for k = {k} >= 1 drafts, got {tuple(logits.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, logits.shape[1]):
        raise ValueError(f"draft_probs must be [k, V] = [{k}, {logits.shape[1]}], got {tuple(draft_probs.shape)}")
    if params.is_greedy:
        targets = logits.argmax(dim=-1).tolist()
        a = 0
        while a < k and draft_ids[a] == targets[a]:
            a += 1
        return Verdict(draft_ids[:a] + [targets[a]], a)
    probs = filtered_probs(logits, [params] * (k + 1))  # [1 + k, V]
    rows, ids = torch.arange(k), torch.tensor(draft_ids)
    accept_p = probs[rows, ids].tolist()
    draft_q = [1.0] * k if draft_probs is None else draft_probs.to(probs.device, probs.dtype)[rows, ids].tolist()
    for i, (draft, p, q) in enumerate(zip(draft_ids, accept_p, draft_q)):
        if q > 0 and _uniform(params.seed, num_output_tokens + i) * q < p:
            continue
        if draft_probs is None:
            residual = probs[i : i + 1].clone()
            residual[0, draft] = 0.0
        else:  # p(d) < q(d) here, so the residual has mass
            residual = (probs[i : i + 1] - draft_probs[i : i + 1].to(probs.device, probs.dtype)).clamp_min_(0.0)
        return Verdict(draft_ids[:i] + [_race(residual, params.seed, num_output_tokens + i, _RECOVER)], i)
    return Verdict(list(draft_ids) + [_race(probs[k : k + 1], params.seed, num_output_tokens + k, _BONUS)], k)


def sample_draft(probs: torch.Tensor, seed: int | None, position: int) -> int:
    """A probabilistic drafter's token at output `position` from its q, `probs` [1, V]: seeded requests from their
    own stream (purpose _DRAFT), independent of the verify step's draws at that position."""
    return _race(probs, seed, position, _DRAFT)


def _uniform(seed: int | None, position: int) -> float:
    return float(torch.rand(1, generator=draw_stream(seed, position, _ACCEPT)))


def _race(weights: torch.Tensor, seed: int | None, position: int, purpose: int) -> int:
    """A draw with probability proportional to `weights` [1, V] (no need to normalise): argmax(w / E), E ~ Exp(1)."""
    noise = exponential_noise(weights.shape, [draw_stream(seed, position, purpose)], weights.device)
    return int((weights / noise).argmax(dim=-1))
