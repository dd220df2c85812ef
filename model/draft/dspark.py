"""DSpark-style parallel block drafting (method `dspark`): one drafter forward a step proposes K tokens.

Context rows: position p's input is hidden_norm(fc(concat of the target's outputs of `dspark_target_layer_ids`
at p)); they write the drafter's latent cache (its context KV, vLLM's `precompute_and_store_context_kv`), as the
block rows do. Block rows: [t_N, noise x (K - 1)] at positions N .. N + K - 1 (N: the request's computed tokens
after the step, t_N its last, uncomputed token), embedded by the target's embedding; block row j's output through
the target's lm_head scores draft j + 1. The block attends causally (the MLA prefill path), to the context and to
its earlier rows. With a Markov head (`dspark_markov_rank` r > 0) the drafts are then chosen left to right, row j's
logits plus markov_w2 . markov_w1[d_j] (d_0 = t_N), as vLLM's `sample_dspark_markov_block`; without one each row's
logits alone. Tensor names as DFlash's and vLLM's DSpark (`model.fc.weight` [hidden, L hidden],
`model.hidden_norm.weight`, `model.layers.0.*`, `model.norm.weight`, `model.markov_head.markov_w1.weight` [V, r],
`model.markov_head.markov_w2.weight` [V, r])."""

from __future__ import annotations

import torch

from torch import nn

from k3serve.kernels.linear import linear
from k3serve.model.draft.base import Drafter
from k3serve.model.draft.config import DrafterConfig
from k3serve.model.layers.common import Linear
from k3serve.model.layers.vocab import VocabParallelEmbedding
from k3serve.model.parallel import SINGLE


class MarkovHead(nn.Module):
    """`model.markov_head`: a low-rank previous-token bias over the vocabulary."""

    def __init__(self, vocab_size: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.markov_w1 = VocabParallelEmbedding(vocab_size, rank, SINGLE, dtype)
        self.markov_w2 = Linear(rank, vocab_size, dtype)

    def bias(self, prev_token_ids: torch.Tensor) -> torch.Tensor:
        """[B, V] fp32: the bias after each of `prev_token_ids` [B]."""
        return linear(self.markov_w1(prev_token_ids).float(), self.markov_w2.weight.float())


class DSparkDrafter(Drafter):
    method = "dspark"

    def __init__(self, config: DrafterConfig, dtype: torch.dtype) -> None:
        super().__init__(config, config.aux_hidden_size, hidden_norm=True, dtype=dtype)
        if config.markov_rank:
            self.model.markov_head = MarkovHead(config.model.vocab_size, config.markov_rank, dtype)

    @torch.inference_mode()
    def markov_bias(self, prev_token_ids: torch.Tensor) -> torch.Tensor | None:
        """[B, V] fp32 added to a block row's logits after `prev_token_ids`; None without a Markov head."""
        head = getattr(self.model, "markov_head", None)
        return None if head is None else head.bias(prev_token_ids)

    @torch.inference_mode()
    def context_inputs(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] of the target features [T, L hidden] of T positions."""
        return self.model.hidden_norm(self.model.fc(aux_hidden))

    @torch.inference_mode()
    def block_inputs(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(token_ids)
