"""The routing order is a specification, not an accident of torch.topk: descending biased score, equal scores
by ascending expert id; the fused experts sum in that order, and the GPU router must reproduce it."""

from __future__ import annotations

import torch

from k3serve.kernels.moe import select_experts


def test_equal_scores_go_to_the_lower_expert_id() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0, 1.0]])  # three experts tied at the top, three below
    _, ids = select_experts(logits, None, 4, False, 1.0)
    assert ids.tolist() == [[1, 3, 5, 0]]
    _, ids = select_experts(torch.zeros(1, 896), None, 16, True, 1.0)
    assert ids.tolist() == [list(range(16))]


def test_bias_ties_keep_the_id_order() -> None:
    """The bias can make different logits tie: the lower id still comes first."""
    probs = torch.tensor([[0.75, 0.5, 0.25]])
    bias = torch.tensor([0.0, 0.25, 0.5])  # every biased score is 0.75 (exact in binary)
    weights, ids = select_experts(torch.log(probs / (1 - probs)), bias, 3, False, 1.0)
    assert ids.tolist() == [[0, 1, 2]]
    torch.testing.assert_close(weights, probs)
