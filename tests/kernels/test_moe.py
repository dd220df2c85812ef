"""MoE reference: routing by hand, activations, the expert sum against a dense loop, MXFP4 and EP splits."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from k3serve.kernels.moe import ExpertWeights, fused_experts, select_experts, silu_glu, situ_glu
from k3serve.kernels.mxfp4 import quantize_mxfp4

from _close import assert_close

SITU = functools.partial(situ_glu, beta=4.0, linear_beta=25.0)


def test_select_experts_by_hand() -> None:
    """sigmoid(logits) = [.9, .6, .5, .2]; bias +0.5 on expert 3 moves it into the top 2, weights stay unbiased."""
    probs = torch.tensor([[0.9, 0.6, 0.5, 0.2]])
    logits = torch.log(probs / (1 - probs))
    w, ids = select_experts(logits, None, 2, False, 1.0)
    assert ids.tolist() == [[0, 1]] and ids.dtype == torch.int64
    assert_close("w_nobias", torch.tensor([[0.9, 0.6]]), w, 1e-6, 0)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.5])
    w, ids = select_experts(logits, bias, 2, False, 1.0)
    assert ids.tolist() == [[0, 3]]
    assert_close("w_bias", torch.tensor([[0.9, 0.2]]), w, 1e-6, 0)
    w, ids = select_experts(logits.bfloat16(), bias, 2, True, 2.446)
    assert w.dtype == torch.float32
    sig = torch.sigmoid(logits.bfloat16().float())[0, [0, 3]]
    assert_close("w_renorm", (sig / (sig.sum() + 1e-20) * 2.446)[None], w, 1e-6, 1e-6)


def test_activations() -> None:
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(5, 24, generator=gen) * 8, torch.randn(5, 24, generator=gen) * 40
    ref = 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * (25 * torch.tanh(up / 25))
    assert_close("situ", ref, SITU(gate, up), 1e-6, 1e-6)
    assert_close("silu", F.silu(gate) * up, silu_glu(gate, up), 1e-6, 1e-6)
    assert SITU(gate.bfloat16(), up.bfloat16()).dtype == torch.bfloat16


def _dense_moe(x, w1, w3, w2, topk_weights, topk_ids, act) -> torch.Tensor:
    """Token-by-token, slot-by-slot: the definition, nothing shared with the reference."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = act((w1[e].float() @ x[t].float())[None], (w3[e].float() @ x[t].float())[None])[0]
            out[t] += topk_weights[t, j] * (w2[e].float() @ h.float())
    return out


def _problem(seed: int, T: int = 11, D: int = 64, I: int = 96, E: int = 6, k: int = 3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    w1 = torch.randn(E, I, D, generator=gen) / math.sqrt(D)
    w3 = torch.randn(E, I, D, generator=gen) / math.sqrt(D)
    w2 = torch.randn(E, D, I, generator=gen) / math.sqrt(I)
    topk_weights, topk_ids = select_experts(torch.randn(T, E, generator=gen), None, k, True, 1.5)
    return x, w1, w3, w2, topk_weights, topk_ids


@pytest.mark.parametrize("act_name", ["situ", "silu"])
def test_fused_experts_vs_dense(act_name: str) -> None:
    act = SITU if act_name == "situ" else silu_glu
    x, w1, w3, w2, topk_weights, topk_ids = _problem(1)
    out = fused_experts(x, ExpertWeights(w1, w3, w2), topk_weights, topk_ids, act)
    assert out.dtype == torch.float32
    assert_close("fused_experts", _dense_moe(x, w1, w3, w2, topk_weights, topk_ids, act), out, 1e-5, 1e-5)


def test_fused_experts_mxfp4_equals_dequantized_dense() -> None:
    x, w1, w3, w2, topk_weights, topk_ids = _problem(2)
    q1, q3, q2 = quantize_mxfp4(w1), quantize_mxfp4(w3), quantize_mxfp4(w2)
    out = fused_experts(x, ExpertWeights(q1, q3, q2), topk_weights, topk_ids, SITU)
    dense = ExpertWeights(q1.dequantize(), q3.dequantize(), q2.dequantize())
    assert_close("mxfp4_vs_dequantized", fused_experts(x, dense, topk_weights, topk_ids, SITU), out, 0, 0)


def test_expert_parallel_split_sums_to_full() -> None:
    x, w1, w3, w2, topk_weights, topk_ids = _problem(3, E=8)
    full = fused_experts(x.bfloat16(), ExpertWeights(w1, w3, w2), topk_weights, topk_ids, SITU)
    shards = [ExpertWeights(w1[s : s + 4], w3[s : s + 4], w2[s : s + 4]) for s in (0, 4)]
    ranks = [fused_experts(x.bfloat16(), w, topk_weights, topk_ids, SITU, s) for w, s in zip(shards, (0, 4))]
    assert_close("ep_sum", full, ranks[0] + ranks[1], 1e-5, 1e-5)
    assert (ranks[0] != 0).any() and (ranks[1] != 0).any()


def test_tokens_without_local_experts_are_zero() -> None:
    x, w1, w3, w2, _, _ = _problem(4, T=3, E=4)
    topk_ids = torch.tensor([[0, 1], [2, 3], [5, 6]])  # ids 4.. live on another rank
    out = fused_experts(x, ExpertWeights(w1, w3, w2), torch.ones(3, 2), topk_ids, silu_glu)
    assert (out[2] == 0).all() and (out[:2] != 0).any(dim=-1).all()


def test_validation() -> None:
    x, w1, w3, w2, topk_weights, topk_ids = _problem(5)
    with pytest.raises(ValueError, match="w2"):
        ExpertWeights(w1, w3, w1)
    with pytest.raises(ValueError, match="x must be"):
        fused_experts(x[:, :10], ExpertWeights(w1, w3, w2), topk_weights, topk_ids, silu_glu)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.randn(2, 4), None, 5, True, 1.0)
