"""EAGLE (method `eagle`): the drafter's input at position p is fc([embed(t_{p+1}); h_p]), h_p the target's final
hidden state at p (what its lm_head read) or, along a draft, the drafter's own pre-norm output at p - 1's row;
one decoder layer; the target's lm_head over its normalized output predicts t_{p+2}. K drafts take one forward
over the step's new positions (the context rows) and K - 1 one-row forwards (vLLM `llama_eagle.py`,
`EagleProposer`). Tensor names as vLLM loads EAGLE checkpoints: `model.fc.weight` [hidden, 2 hidden],
`model.layers.0.*`, `model.norm.weight`."""

from __future__ import annotations

import torch

from k3serve.model.draft.base import Drafter
from k3serve.model.draft.config import DrafterConfig


class EagleDrafter(Drafter):
    method = "eagle"

    def __init__(self, config: DrafterConfig, dtype: torch.dtype) -> None:
        super().__init__(config, 2 * config.model.hidden_size, hidden_norm=False, dtype=dtype)

    @torch.inference_mode()
    def inputs(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden]: fc([embed(token_ids); hidden]) (hidden: the target's, or the drafter's own output)."""
        emb = self.embed(token_ids)
        return self.model.fc(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))
