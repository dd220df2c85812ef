"""The K3 decoder: embedding, hybrid KDA/MLA layers with (latent) MoE, attention residuals, lm_head.

Module names mirror the checkpoint (`model.layers.N.self_attn.q_proj.weight`, `lm_head.weight`),
so weight loading is a name lookup. The whole interface to the engine is

    hidden = model(batch, cache)                 # [T, hidden], advances the caches of batch
    logits = model.compute_logits(hidden[rows])  # [rows, vocab] fp32 on rank 0; None on ranks > 0

The embedding and lm_head are vocab-parallel (`layers/vocab.py`): at TP > 1 each rank holds its block
of vocab rows, and the logits are gathered to rank 0, the only rank that samples.

Attention residuals (K3, `attn_res_block_size`): instead of a plain residual stream, each layer
reads a softmax-weighted mix of block snapshots ("bank") and the running block sum ("prefix"),
both before attention and before the MLP; every `attn_res_block_size` layers the prefix is
frozen into the bank and restarts (model/K3_MODEL.md §1f).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from k3serve.kernels._backend import reference_kernels_in_thread
from k3serve.kernels.attn_res import attn_res_aggregate, fold_score_weight
from k3serve.model.batch import ForwardBatch, ModelCache
from k3serve.model.config import ModelConfig
from k3serve.model.layers.common import Linear, RMSNorm, keep_address
from k3serve.model.layers.kda import KimiDeltaAttention
from k3serve.model.layers.mla import MLAAttention
from k3serve.model.layers.mlp import DenseMLP, SparseMoE, glu_activation
from k3serve.model.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from k3serve.model.parallel import SINGLE, TensorParallel


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = config.is_kda_layer(layer_idx)
        self.res_block = config.attn_res_block_size
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = (KimiDeltaAttention if self.is_kda else MLAAttention)(config, tp, dtype)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = SparseMoE(config, tp, dtype)
        else:
            self.mlp = DenseMLP(hidden, config.intermediate_size, glu_activation(config), tp, dtype)
        self.tp = tp
        if self.res_block:
            # Named as in the checkpoint: self_attention_res_{proj,norm}, mlp_res_{proj,norm}.
            self.self_attention_res_proj = Linear(hidden, 1, dtype)
            self.self_attention_res_norm = RMSNorm(hidden, eps, dtype)
            self.mlp_res_proj = Linear(hidden, 1, dtype)
            self.mlp_res_norm = RMSNorm(hidden, eps, dtype)
            self.attn_res_scores: tuple[torch.Tensor, torch.Tensor] | None = None  # see process_weights_...

    def process_weights_after_loading(self) -> None:
        """The two mixes' score vectors, folded once (`fold_score_weight`): 2 x hidden fp32 a layer."""
        if self.res_block:
            self.attn_res_scores = _fold_scores(
                self.attn_res_scores,
                (self.self_attention_res_proj, self.self_attention_res_norm), (self.mlp_res_proj, self.mlp_res_norm),
            )

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(x)
        return self.tp.all_reduce(self.mlp(x))

    def _attn(self, x: torch.Tensor, batch: ForwardBatch, cache: ModelCache, cache_idx: int) -> torch.Tensor:
        """Attention of x, already normalized by input_layernorm."""
        if self.is_kda:
            return self.self_attn(x, batch, cache.kda_recurrent[cache_idx], cache.kda_conv[cache_idx])
        return self.self_attn(x, batch, cache.mla_kv[cache_idx])

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache: ModelCache, cache_idx: int) -> torch.Tensor:
        """Plain pre-norm residual block."""
        h = h + self._attn(self.input_layernorm(h), batch, cache, cache_idx)
        return h + self._mlp(self.post_attention_layernorm(h))

    def forward_attn_res(self, sources: torch.Tensor, k: int, pending: torch.Tensor | None, batch: ForwardBatch,
                         cache: ModelCache, cache_idx: int) -> tuple[int, torch.Tensor]:
        """Attention-residual block over `sources` [S, T, D]: rows < k are the bank, row k the prefix
        (block sum), updated in place; a restart freezes row k and starts the new prefix in row k + 1.
        `pending` is the previous layer's output that row k still lacks. Returns the prefix row and this
        layer's output still to add to it: each addition rides in the next mix's launch, and the rows
        are what the mixes read, so no mix stacks the bank again."""
        attn_scores, mlp_scores = self.attn_res_scores
        x = _mix_norm(sources, k, attn_scores, self.self_attention_res_norm.eps, self.input_layernorm, pending)
        a = self._attn(x, batch, cache, cache_idx)
        if self.layer_idx % self.res_block == 0:
            k += 1
            sources[k].copy_(a)
            a = None
        x = _mix_norm(sources, k, mlp_scores, self.mlp_res_norm.eps, self.post_attention_layernorm, a)
        return k, self._mlp(x)


def _mix_norm(sources: torch.Tensor, k: int, score_weight: torch.Tensor, eps: float, norm: RMSNorm,
              pending: torch.Tensor | None) -> torch.Tensor:
    """norm(the mix of rows 0..k) (row 0 alone before the first snapshot), after row k += pending: every
    mix follows such an addition and feeds such a norm, so the three run as one kernel."""
    return attn_res_aggregate(sources[: k + 1], score_weight, eps, norm.weight, norm.eps, pending)


def _fold_scores(current: tuple[torch.Tensor, ...] | None, *pairs: tuple[Linear, RMSNorm]) -> tuple[torch.Tensor, ...]:
    """Each (proj, norm) pair's folded score vector, refreshed in place when `current` holds them."""
    folded = [fold_score_weight(proj.weight.reshape(-1), norm.weight) for proj, norm in pairs]
    return tuple(keep_address(old, new) for old, new in zip(current or (None,) * len(folded), folded))


class KimiModel(nn.Module):
    """`model.*` of the checkpoint."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.attn_res_block_size:
            self.output_attn_res_proj = Linear(config.hidden_size, 1, dtype)
            self.output_attn_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.output_attn_res_scores: tuple[torch.Tensor] | None = None  # see process_weights_after_loading
        # cache_idx of each layer: its index among the KDA layers or among the MLA layers
        self._cache_idx = [
            (config.kda_layers if config.is_kda_layer(i) else config.mla_layers).index(i)
            for i in range(config.num_hidden_layers)
        ]

    def process_weights_after_loading(self) -> None:
        """The output mix's score vector, folded once (`fold_score_weight`)."""
        if self.config.attn_res_block_size:
            self.output_attn_res_scores = _fold_scores(
                self.output_attn_res_scores, (self.output_attn_res_proj, self.output_attn_res_norm)
            )

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """[T, hidden] after the final norm; the outputs of `batch.aux_layer_ids` go to `batch.aux_hidden` (with
        attention residuals a layer's output is its block's running sum: the residual stream's counterpart)."""
        if not self.config.attn_res_block_size:
            h = self.embed_tokens(batch.token_ids)
            for layer, idx in zip(self.layers, self._cache_idx):
                h = layer(h, batch, cache, idx)
                if layer.layer_idx in batch.aux_layer_ids:
                    batch.aux_hidden[layer.layer_idx] = h
            return self.norm(h)
        # rows: one snapshot per block start (layer_idx % block == 0), then the running prefix
        snapshots = -(-self.config.num_hidden_layers // self.config.attn_res_block_size)
        table = self.embed_tokens.weight
        sources = table.new_empty(snapshots + 1, batch.token_ids.shape[0], table.shape[1])
        self.embed_tokens(batch.token_ids, out=sources[0])  # the embedding, looked up in place
        k, pending = 0, None
        for layer, idx in zip(self.layers, self._cache_idx):
            k, pending = layer.forward_attn_res(sources, k, pending, batch, cache, idx)
            if layer.layer_idx in batch.aux_layer_ids:  # the block's sum so far, this layer's output included
                batch.aux_hidden[layer.layer_idx] = sources[k] + pending
        (scores,) = self.output_attn_res_scores
        return _mix_norm(sources, k, scores, self.output_attn_res_norm.eps, self.norm, pending)


class KimiForCausalLM(nn.Module):
    """The text model of Kimi-K3 / Kimi Linear: `model.*` + untied `lm_head`."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        config.check_tp(tp.world_size)
        self.config, self.tp, self.dtype = config, tp, dtype
        self.model = KimiModel(config, tp, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        self.weights_processed = False
        self.reference_kernels = False  # see use_kernels

    def use_kernels(self, reference: bool = False, moe_finalize: Literal["fused", "unfused"] = "fused") -> None:
        """The kernels this model's forward and logits run (the engine's `kernels` / `moe_finalize` arguments):
        `reference` runs every op's torch reference in the calling thread (`reference_kernels_in_thread`),
        `moe_finalize` the routed experts' top-k sum fused in their kernels or not (`kernels.moe`)."""
        self.reference_kernels = reference
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.finalize = moe_finalize

    def process_weights_after_loading(self) -> None:
        """Derive the per-layer forms of the loaded weights (fp32 copies, packed blocks) once, instead
        of every step; call it again after any reload (`load_model` does). Derived tensors keep their
        addresses, so captured CUDA graphs see reloaded weights."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        self.weights_processed = True

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Run the new tokens of every sequence in `batch`, advancing its caches. Returns [T, hidden]."""
        if not self.weights_processed:
            raise RuntimeError("weights are not processed: call process_weights_after_loading() after loading them")
        with reference_kernels_in_thread(self.reference_kernels):
            return self.model(batch, cache)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] fp32 logits of `hidden` [rows, hidden] on rank 0; None on the other ranks of a TP
        model, which must call it too, in the same order as rank 0 (the logits are gathered)."""
        with reference_kernels_in_thread(self.reference_kernels):
            return self.lm_head.gather(self.lm_head.compute_logits(hidden))
