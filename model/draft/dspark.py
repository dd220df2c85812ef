"""DSpark-style parallel block drafting (method `dspark`): one drafter forward a step proposes K tokens.

Context rows: position p's input is hidden_norm(fc(concat of the target's outputs of `dspark_target_layer_ids`
at p)); they write the drafter's latent cache (its context KV, vLLM's `precompute_and_store_context_kv`), as the
block rows do. Block rows: [t_N, noise x (K - 1)] at positions N .. N + K - 1 (N: the request's computed tokens
after the step, t_N its last, uncomputed token), embedded by the target's embedding; block row j's output through
the target's lm_head scores draft j + 1. The block attends causally (the MLA prefill path), to the context and to
its earlier rows; each row's draft is chosen from its own logits (no Markov head). Tensor names as DFlash's
(`model.fc.weight` [hidden, L hidden], `model.hidden_norm.weight`, `model.layers.0.*`, `model.norm.weight`)."""

from __future__ import annotations

import torch

from k3serve.model.draft.base import Drafter
from k3serve.model.draft.config import DrafterConfig


class DSparkDrafter(Drafter):
    method = "dspark"

    def __init__(self, config: DrafterConfig, dtype: torch.dtype) -> None:
        super().__init__(config, config.aux_hidden_size, hidden_norm=True, dtype=dtype)

    @torch.inference_mode()
    def context_inputs(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] of the target features [T, L hidden] of T positions."""
        return self.model.hidden_norm(self.model.fc(aux_hidden))

    @torch.inference_mode()
    def block_inputs(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(token_ids)
