"""Specification: rejection sampling of deterministic drafts emits the target's distribution exactly.

A Markov target on a 4-token vocabulary, filtered as a request asks (temperature 0.8, top_k 3: one token of each
row has probability 0), generates 3 tokens from a start token many times; drafts come from a fixed rule, as prompt
lookup's do, some of them tokens the target never emits. The joint law of the 3 emitted tokens must be the
target's: a chi-square goodness-of-fit test over the cells the target can reach (p threshold 1e-3), and no
unreachable cell ever hit. Greedy requests emit the argmax chain; seeded ones repeat themselves.
"""

from __future__ import annotations

import itertools
import math

import torch

from k3serve.engine.sampler import filtered_probs
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.rejection import rejection_sample

V, K, LENGTH, DRAWS = 4, 2, 3, 4000
P_THRESHOLD_Z = 3.0902  # the standard normal's upper 1e-3 quantile
TRANSITION_LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.4], [0.1, 1.2, 0.3, -1.0], [0.5, -0.2, 0.0, 0.9],
                                  [-0.3, 0.6, 1.1, 0.2]])


def _draft_rule(token: int) -> int:
    return (token * 3 + 1) % V  # deterministic, sometimes a token the filtered target cannot emit


def _generate(params: SamplingParams, start: int) -> list[int]:
    out: list[int] = []
    last = start
    while len(out) < LENGTH:
        drafts, t = [], last
        for _ in range(K):
            t = _draft_rule(t)
            drafts.append(t)
        rows = TRANSITION_LOGITS[[last] + drafts]  # row i scores the token after the path's i-th token
        out += rejection_sample(rows, drafts, params, len(out)).token_ids
        last = out[-1]
    return out[:LENGTH]


def _chi2_critical(df: int) -> float:
    """Wilson-Hilferty: the chi-square quantile at P_THRESHOLD_Z (within ~1% for df >= 10)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + P_THRESHOLD_Z * math.sqrt(c)) ** 3


def test_the_joint_law_of_the_first_tokens_is_the_targets() -> None:
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.8, top_k=3)
    p = filtered_probs(TRANSITION_LOGITS, [params] * V)  # p[a, b] = P(next = b | last = a)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(DRAWS):
        seq = tuple(_generate(params, start=0))
        counts[seq] = counts.get(seq, 0) + 1
    chi2, df = 0.0, -1
    for cell in itertools.product(range(V), repeat=LENGTH):
        prob = float(p[0, cell[0]] * p[cell[0], cell[1]] * p[cell[1], cell[2]])
        if prob == 0.0:
            assert cell not in counts, f"emitted {cell}, which the filtered target never emits"
            continue
        expected = prob * DRAWS
        chi2 += (counts.get(cell, 0) - expected) ** 2 / expected
        df += 1
    assert chi2 < _chi2_critical(df), f"chi2 {chi2:.1f} on {df} dof: not the target's law"


def test_greedy_accepts_while_drafts_are_the_argmax_then_emits_it() -> None:
    greedy = SamplingParams(temperature=0.0)
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    assert rejection_sample(logits, [1, 0, 2], greedy, 0).token_ids == [1, 0, 2, 0]  # all pass, then the bonus
    verdict = rejection_sample(logits, [1, 2, 2], greedy, 0)
    assert (verdict.token_ids, verdict.num_accepted) == ([1, 0], 1)


def test_a_seeded_request_draws_the_same_tokens_every_time() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    runs = {tuple(_generate(params, start=2)) for _ in range(5)}
    assert len(runs) == 1
