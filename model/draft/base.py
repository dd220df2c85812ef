"""What every drafter is: `model.fc` (target features -> hidden), one K3 decoder layer (MLA over its own latent
cache, a dense MLP), `model.norm`, and the target's embedding and lm_head, shared (bound after loading, never
loaded from the drafter's checkpoint). Tensor names are the published EAGLE / DFlash ones under `model.`
(`fc.weight`, `hidden_norm.weight`, `layers.0.*`, `norm.weight`), the layer's own K3 names inside it.

The drafter runs unsharded on rank 0 of a TP engine (rank 0 alone samples, drafts included), so at TP > 1 it is
bound to full copies of the target's two tables (`loader.py`). Its forward is the target layer's: a
`ForwardBatch` over the drafter's positions and a one-layer `ModelCache` indexed by the target's block ids.
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve.kernels._backend import reference_kernels_in_thread
from k3serve.model.batch import ForwardBatch, ModelCache
from k3serve.model.draft.config import DrafterConfig
from k3serve.model.layers.common import Linear, RMSNorm
from k3serve.model.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from k3serve.model.model import DecoderLayer
from k3serve.model.parallel import SINGLE


class DrafterBody(nn.Module):
    """`model.*` of a drafter checkpoint."""

    def __init__(self, config: DrafterConfig, fc_in: int, hidden_norm: bool, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = config.model.hidden_size, config.model.rms_norm_eps
        self.fc = Linear(fc_in, hidden, dtype)
        if hidden_norm:
            self.hidden_norm = RMSNorm(hidden, eps, dtype)
        self.layers = nn.ModuleList([DecoderLayer(config.model, 0, SINGLE, dtype)])
        self.norm = RMSNorm(hidden, eps, dtype)


class Drafter(nn.Module):
    """A drafter's weights and its forward pieces; `bind` gives it the target's embedding and lm_head."""

    method = ""

    def __init__(self, config: DrafterConfig, fc_in: int, hidden_norm: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.drafter_config = config
        self.config = config.model  # what the weight loader reads (weight_prefix "")
        self.tp = SINGLE
        self.dtype = dtype
        self.model = DrafterBody(config, fc_in, hidden_norm, dtype)
        self.weights_processed = False
        self.reference_kernels = False
        self._head: tuple[VocabParallelEmbedding, ParallelLMHead] | None = None  # not submodules: not loaded here

    def bind(self, embed_tokens: VocabParallelEmbedding, lm_head: ParallelLMHead) -> None:
        """The target's vocab tables, unsharded (TP 1's own, or rank 0's full copies)."""
        if embed_tokens.tp.world_size != 1 or lm_head.tp.world_size != 1:
            raise ValueError("a drafter runs on one rank: it needs unsharded embedding and lm_head tables")
        self._head = (embed_tokens, lm_head)

    def process_weights_after_loading(self) -> None:
        for module in self.model.modules():
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        self.weights_processed = True

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._head[0](token_ids)

    @torch.inference_mode()
    def layer(self, x: torch.Tensor, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """The decoder layer over `x` [T, hidden] (its latent rows written to `cache` at `batch`'s positions);
        the pre-norm output [T, hidden]."""
        if not self.weights_processed or self._head is None:
            raise RuntimeError("drafter weights not processed or not bound to the target's embedding and lm_head")
        with reference_kernels_in_thread(self.reference_kernels):
            return self.model.layers[0](x, batch, cache, 0)

    @torch.inference_mode()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] fp32: the target's lm_head over the normalized layer output."""
        with reference_kernels_in_thread(self.reference_kernels):
            head = self._head[1]
            return head.gather(head.compute_logits(self.model.norm(out)))
