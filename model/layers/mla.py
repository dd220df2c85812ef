"""Multi-head latent attention, NoPE (model/K3_MODEL.md §1c, §6).

The cache holds, per token, the normalized latent c (kv_lora_rank) and the shared k_pe
(rope dim, no rotary): replicated on every TP rank, or with decode context parallelism split by sequence
over each DCP group's ranks (`mla_dcp.py`). Prefill uses the compute-friendly MHA form
(up-project k_nope and v from c); single-token sequences use the absorbed form (q_nope folded
into latent space with W_UK, attention over the 576-dim latent keys, W_UV applied after).
Both see exactly the same cached values, and a test holds them equal.
"""

from __future__ import annotations

from functools import partial

import torch

from k3serve.kernels.gate import sigmoid_gate
from k3serve.kernels.head_matmul import head_matmul
from k3serve.kernels.mla import (dcp, gather_kv_cache, mla_decode_paged, mla_prefill_attention, mla_verify_paged,
                                  write_kv_cache)
from k3serve.model.batch import ForwardBatch
from k3serve.model.config import ModelConfig
from k3serve.model.layers import mla_dcp
from k3serve.model.layers.common import Linear, RMSNorm, Sharded, keep_address, project, stack_rows
from k3serve.model.parallel import TensorParallel


class MLAAttention(Sharded):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        _, self.num_heads = tp.shard(config.num_attention_heads, "MLA num_attention_heads")
        self.tp = tp
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = config.qk_head_dim**-0.5  # the pre-absorption dim (192 for K3) in both forms
        hidden, H = config.hidden_size, self.num_heads
        if config.q_lora_rank is None:
            self.q_proj = Linear(hidden, H * config.qk_head_dim, dtype, tp_dim=0)
        else:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype)
            self.q_b_proj = Linear(config.q_lora_rank, H * config.qk_head_dim, dtype, tp_dim=0)
        self.kv_a_proj_with_mqa = Linear(hidden, config.mla_kv_dim, dtype)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps, dtype)
        self.kv_b_proj = Linear(config.kv_lora_rank, H * (self.nope + self.v_dim), dtype, tp_dim=0)
        if config.mla_use_output_gate:
            self.g_proj = Linear(hidden, H * self.v_dim, dtype, tp_dim=0)
        self.o_proj = Linear(H * self.v_dim, hidden, dtype, tp_dim=1)
        self.w_uk: torch.Tensor | None = None  # [H, nope, L] in the weights' dtype: see process_weights_after_loading
        self.w_uv: torch.Tensor | None = None  # fp32 [H, v, L]
        self.x_proj_weight = stack_rows(None, self._projections_of_x())  # q (or q_a), kv_a, g: one GEMM of x
        self._x_proj_sizes = [proj.weight.shape[0] for proj in self._projections_of_x()]

    def _projections_of_x(self) -> list[Linear]:
        q = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        return [q, self.kv_a_proj_with_mqa] + ([self.g_proj] if hasattr(self, "g_proj") else [])

    def process_weights_after_loading(self) -> None:
        """kv_b_proj split per head into W_UK [H, nope, L] and W_UV [H, v, L], the forms the absorbed decode
        multiplies by: W_UK a view of the weight (the query it multiplies is in the weights' dtype, and
        `head_matmul` sums their products in fp32), W_UV in fp32 (it multiplies the fp32 latent output): an
        fp32 copy of half of this rank's kv_b_proj when the model is bf16 (K3 at TP8: 8 heads x 128 x 512 x
        4 B = 2 MiB per MLA layer); none when it is fp32. The projections of x stay stacked (`stack_rows`),
        or are stacked again if their parameters moved."""
        w = self.kv_b_proj.weight.reshape(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        self.w_uk = keep_address(self.w_uk, w[:, : self.nope])
        self.w_uv = keep_address(self.w_uv, w[:, self.nope :].float())
        self.x_proj_weight = stack_rows(self.x_proj_weight, self._projections_of_x())

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q, kv, *gate = project(x, self.x_proj_weight, self._x_proj_sizes)
        if not hasattr(self, "q_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.reshape(T, H, self.nope + self.rope)
        c = kv[:, : self.kv_lora_rank]
        self.kv_a_layernorm(c, out=c)  # in place: kv is now the cache's row [c | k_pe], with no concatenation
        slots = batch.slot_mapping if self.tp.dcp_size == 1 else \
            dcp.local_slots(batch.slot_mapping, kv_cache.shape[1], self.tp.dcp_size, self.tp.dcp_rank)
        write_kv_cache(kv_cache, slots, kv)

        split, spec_end = batch.num_decode_tokens, batch.prefill_token_start
        parts = []
        if batch.num_decode:
            parts.append(self._decode(q[:split], batch, kv_cache))
        if batch.num_spec:
            parts.append(self._verify(q[split:spec_end], batch, kv_cache))
        if spec_end < T:
            parts.append(self._prefill(q[spec_end:], batch, kv_cache))
        o = (torch.cat(parts) if len(parts) > 1 else parts[0]).reshape(T, H * self.v_dim)  # fp32
        # the gate (a projection of the layer input) and the rounding into x's dtype: one launch
        o = sigmoid_gate(o, gate[0], x.dtype) if gate else o.to(x.dtype)
        return self.tp.all_reduce(self.o_proj(o))

    def _decode(self, q: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        n = batch.num_decode
        q_latent = head_matmul(q[..., : self.nope], self.w_uk)  # fp32, from q's head-strided view
        if self.tp.dcp_size > 1:
            o_latent = mla_dcp.decode(self.tp, q_latent, q[..., self.nope :], kv_cache, batch.block_tables[:n],
                                      batch.seq_lens[:n], self.scale, self.kv_lora_rank)
            return head_matmul(o_latent, self.w_uv.transpose(1, 2))
        # q_latent fp32, q_pe a strided view in q's dtype: the reference widens both to fp32, the Triton kernel
        # rounds both to the cache dtype as it loads them (no copies)
        o_latent, _ = mla_decode_paged(
            q_latent, q[..., self.nope :], kv_cache,
            batch.block_tables[:n], batch.seq_lens[:n], self.scale, self.kv_lora_rank,
        )
        return head_matmul(o_latent, self.w_uv.transpose(1, 2))  # o_latent is fp32 (q_latent's dtype)

    def _verify(self, q: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """The verify rows: the absorbed decode over 1 + k query rows a sequence, causal among them."""
        a, b = batch.num_decode, batch.prefill_start
        cu, _ = batch.spec_spans()
        q_latent = head_matmul(q[..., : self.nope], self.w_uk)
        verify = mla_verify_paged if self.tp.dcp_size == 1 else partial(mla_dcp.verify, self.tp)
        o_latent = verify(q_latent, q[..., self.nope :], kv_cache, batch.block_tables[a:b],
                          batch.seq_lens_host[a:b].tolist(), cu, self.scale, self.kv_lora_rank)
        return head_matmul(o_latent, self.w_uv.transpose(1, 2))

    def _prefill(self, q: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """The MHA form over each prefill sequence's whole context, gathered from the cache and up-projected by
        kv_b_proj (~8 KiB a key at K3 TP8), a group of consecutive sequences at a time (`cached_prefix_groups`),
        so that several prefix-cache hits in one step never hold their prefixes' keys at once. The groups come
        from the host copies of the batch's indices: no device read-back."""
        n0 = batch.prefill_start
        cu_q = batch.cu_seqlens_host[n0:] - batch.cu_seqlens_host[n0]  # rows of q
        seq_lens = batch.seq_lens_host[n0:]
        prefix_lens = (seq_lens - cu_q.diff()).tolist()
        bounds = cu_q.tolist()
        parts = [
            self._attend(q[bounds[a] : bounds[b]], kv_cache, batch.block_tables[n0 + a : n0 + b], seq_lens[a:b],
                         cu_q[a : b + 1] - bounds[a])
            for a, b in cached_prefix_groups(prefix_lens)
        ]
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim, dtype=torch.float32)
        return torch.cat(parts, out=out)  # widened to fp32 as it is copied

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                cu_q: torch.Tensor) -> torch.Tensor:
        """Causal attention of sequences' new tokens (q) over their seq_lens cached tokens (host), in q's dtype.
        Its keys and values are freed when it returns: one group's, not the step's."""
        H = self.num_heads
        gather = gather_kv_cache if self.tp.dcp_size == 1 else partial(mla_dcp.gather_context, self.tp)
        cached, cu_k = gather(kv_cache, block_tables, seq_lens)  # host: no sync
        kv = self.kv_b_proj(cached[:, : self.kv_lora_rank]).reshape(-1, H, self.nope + self.v_dim)
        k_pe = cached[:, self.kv_lora_rank :].unsqueeze(1).expand(-1, H, self.rope)
        k = torch.cat([kv[..., : self.nope], k_pe.to(kv.dtype)], dim=-1)
        return mla_prefill_attention(q, k, kv[..., self.nope :], cu_q, cu_k, self.scale)


def cached_prefix_groups(prefix_lens: list[int]) -> list[tuple[int, int]]:
    """Consecutive sequences [start, end), in order, whose cached prefixes sum to at most the longest single one.

    The prefill gathers a group's keys at once: its new tokens and its prefixes, so a step's MLA keys at any
    moment are at most its new tokens plus ONE longest cached prefix (what engine/memory.py sets aside), however
    many prefix-cache hits it admitted. Sequences with no prefix join any group: a step without cached prefixes,
    the common case, is one group, as is one with a single prefix (a chunked prompt). Attention is computed a
    sequence at a time either way; only the rows kv_b_proj multiplies at once change (the same bits on the CPU;
    cuBLAS may pick another kernel for another row count, as for any other batch)."""
    if not prefix_lens:
        return []
    budget = max(prefix_lens)
    groups, start, total = [], 0, 0
    for i, prefix in enumerate(prefix_lens):
        if total + prefix > budget:  # then i > start: one prefix alone never exceeds the budget
            groups.append((start, i))
            start, total = i, 0
        total += prefix
    return groups + [(start, len(prefix_lens))]
