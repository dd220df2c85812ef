"""Attention-residual aggregation: identity for one source, a hand-written per-token loop, and the fused
RMSNorm as the composition it replaces."""

from __future__ import annotations

import math

import pytest
import torch

from k3serve.kernels.attn_res import attn_res_aggregate, fold_score_weight
from k3serve.kernels.norm import rms_norm

from _close import assert_close

EPS = 1e-5


def test_single_source_is_identity() -> None:
    gen = torch.Generator().manual_seed(0)
    sources = torch.randn(1, 5, 40, generator=gen).bfloat16()
    score_weight = fold_score_weight(torch.randn(40, generator=gen), torch.randn(40, generator=gen))
    out = attn_res_aggregate(sources, score_weight, EPS)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, sources[0])
    sources[0].add_(1.0)  # the next layer's prefix update, in place: the mix already handed out keeps its value
    assert not torch.equal(out, sources[0])


@pytest.mark.parametrize("num_sources", [2, 5])
def test_against_loop(num_sources: int) -> None:
    gen = torch.Generator().manual_seed(num_sources)
    S, T, D = num_sources, 6, 40
    sources = torch.randn(S, T, D, generator=gen) * torch.rand(S, 1, 1, generator=gen) * 4
    proj, norm = torch.randn(D, generator=gen), 1 + 0.1 * torch.randn(D, generator=gen)
    ref = torch.zeros(T, D)
    for t in range(T):
        scores = []
        for j in range(S):
            v = sources[j, t]
            rms = math.sqrt(float((v * v).mean()) + EPS)
            scores.append(float(sum((v[d] / rms) * norm[d] * proj[d] for d in range(D))))
        m = max(scores)
        probs = [math.exp(s - m) for s in scores]
        ref[t] = sum(p / sum(probs) * sources[j, t] for j, p in enumerate(probs))
    assert_close("attn_res", ref, attn_res_aggregate(sources, fold_score_weight(proj, norm), EPS), 1e-5, 1e-5)


def test_validation() -> None:
    with pytest.raises(ValueError, match="proj_weight"):
        fold_score_weight(torch.zeros(1, 8), torch.zeros(8))
    with pytest.raises(ValueError, match="score_weight"):
        attn_res_aggregate(torch.zeros(2, 3, 8), torch.zeros(8, dtype=torch.bfloat16), EPS)
    with pytest.raises(ValueError, match="norm_weight"):
        attn_res_aggregate(torch.zeros(2, 3, 8), torch.zeros(8), EPS, torch.ones(7), 1e-6)


def test_norm_weight_normalizes_the_rounded_mix() -> None:
    """The fused form is the two calls it replaces: rms_norm of the mix as rounded to sources.dtype."""
    gen = torch.Generator().manual_seed(7)
    sources = (torch.randn(3, 4, 40, generator=gen) * 3).bfloat16()
    score_weight, norm_weight = torch.randn(40, generator=gen), (1 + torch.randn(40, generator=gen)).bfloat16()
    mix = attn_res_aggregate(sources, score_weight, EPS)
    expected = rms_norm(mix, norm_weight, 1e-6)
    assert torch.equal(attn_res_aggregate(sources, score_weight, EPS, norm_weight, 1e-6), expected)
    assert torch.equal(attn_res_aggregate(sources[:1], score_weight, EPS, norm_weight, 1e-6),
                       rms_norm(sources[0], norm_weight, 1e-6))
