"""Kimi Delta Attention layer (model/K3_MODEL.md §1d): projections, short conv, gate, delta rule, gated norm.

Per rank it owns H/tp heads. The recurrent state ([H_local, K, V] fp32) and the conv window
(the last kernel-1 pre-conv inputs of the q, k and v channels, packed as one [3*P_local, W-1]
block) live in the engine's slot pools; this layer reads the slot of each sequence, advances it
exactly once per new token, and optionally emits an in-pass checkpoint into a second slot.

A batch with verify rows (speculative decoding) runs three slices into one output: its decodes one step each,
its verify rows from their slots read-only (`kda_verify`, `conv_verify`; the records go to
`batch.verify_records` for `commit_verified`, which folds each accepted prefix in after rejection), its
prefills chunked.
"""

from __future__ import annotations

import torch

from k3serve.kernels.conv import causal_conv1d, conv_commit, conv_verify
from k3serve.kernels.kda import CHUNK_SIZE, chunk_kda, kda_commit, kda_decode, kda_gate, kda_verify
from k3serve.kernels.norm import gated_rms_norm
from k3serve.model.batch import ForwardBatch, VerifyRecords
from k3serve.model.config import ModelConfig
from k3serve.model.layers.common import Linear, Sharded, keep_address, project, stack_rows
from k3serve.model.parallel import TensorParallel


class ShortConv(Sharded):
    """Depthwise conv weight [P, 1, W] (fp32, no bias), split by channel."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = self.add_param("weight", (channels, 1, kernel), torch.float32, 0)


class KimiDeltaAttention(Sharded):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        kda = config.kda
        _, self.num_heads = tp.shard(kda.num_heads, "KDA num_heads")
        self.head_dim = d = kda.head_dim
        self.lower_bound = kda.gate_lower_bound
        self.eps = config.rms_norm_eps
        self.tp = tp
        hidden, p = config.hidden_size, self.num_heads * d
        self.q_proj = Linear(hidden, p, dtype, tp_dim=0)
        self.k_proj = Linear(hidden, p, dtype, tp_dim=0)
        self.v_proj = Linear(hidden, p, dtype, tp_dim=0)
        self.q_conv1d = ShortConv(p, kda.conv_kernel_size)
        self.k_conv1d = ShortConv(p, kda.conv_kernel_size)
        self.v_conv1d = ShortConv(p, kda.conv_kernel_size)
        self.f_a_proj = Linear(hidden, d, dtype)
        self.f_b_proj = Linear(d, p, dtype, tp_dim=0)
        self.b_proj = Linear(hidden, self.num_heads, dtype, tp_dim=0)
        self.A_log = self.add_param("A_log", (self.num_heads,), torch.float32, 0)
        self.dt_bias = self.add_param("dt_bias", (p,), torch.float32, 0)
        if kda.use_full_rank_gate:
            self.g_proj = Linear(hidden, p, dtype, tp_dim=0)
        else:
            self.g_a_proj = Linear(hidden, d, dtype)
            self.g_b_proj = Linear(d, p, dtype, tp_dim=0)
        self.o_norm = Sharded()
        self.o_norm.add_param("weight", (d,), torch.float32, None)
        self.o_proj = Linear(p, hidden, dtype, tp_dim=1)
        self._num_heads_total = kda.num_heads
        self.conv_weight: torch.Tensor | None = None  # [3P, W]: see process_weights_after_loading
        # one GEMM for every projection of x: q, k, v (the conv input, in one slice), f_a, b, the gate
        self.x_proj_weight = stack_rows(None, self._projections_of_x())  # [3P + d + H + gate, hidden]
        self._x_proj_sizes = [3 * p, d, self.num_heads, p if kda.use_full_rank_gate else d]

    def _projections_of_x(self) -> list[Linear]:
        gate = self.g_proj if hasattr(self, "g_proj") else self.g_a_proj
        return [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, gate]

    def process_weights_after_loading(self) -> None:
        """The q, k and v conv weights packed as the one [3P_local, W] fp32 block the conv kernel takes
        (it runs the three as one conv); a copy of 3*P_local*W floats (72 KiB per K3 layer at TP8). The
        projections of x stay stacked (`stack_rows`), or are stacked again if their parameters moved."""
        packed = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        self.conv_weight = keep_address(self.conv_weight, packed)
        self.x_proj_weight = stack_rows(self.x_proj_weight, self._projections_of_x())

    def prepare_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A_log is per head. Kimi Linear ships [1, 1, H, 1]; K3 ships 128 entries for 96 heads,
        of which vLLM and SGLang use the first H (the rest is padding)."""
        if name != "A_log":
            return tensor
        flat = tensor.reshape(-1)
        if flat.numel() < self._num_heads_total:
            raise ValueError(f"A_log has {flat.numel()} entries for {self._num_heads_total} KDA heads")
        return flat[: self._num_heads_total]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, recurrent: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
        T, H, d = x.shape[0], self.num_heads, self.head_dim
        qkv_in, f_a, b, gate_in = project(x, self.x_proj_weight, self._x_proj_sizes)  # qkv_in [T, 3P]
        g = kda_gate(self.f_b_proj(f_a).reshape(T, H, d), self.A_log, self.dt_bias, self.lower_bound)
        if batch.num_spec == 0:
            o = self._attend(qkv_in, g, b, batch, recurrent, conv)
        else:  # [decodes | verify rows | prefills], each slice straight into o
            o = x.new_empty(T, H, d)
            nd, p0, s0 = batch.num_decode, batch.prefill_start, batch.prefill_token_start
            if nd:
                o[:nd] = self._attend(qkv_in[:nd], g[:nd], b[:nd], batch.part(0, nd), recurrent, conv)
            o[nd:s0] = self._verify(qkv_in[nd:s0], g[nd:s0], b[nd:s0], batch, recurrent, conv)
            if s0 < T:
                o[s0:] = self._attend(qkv_in[s0:], g[s0:], b[s0:], batch.part(p0, batch.num_seqs), recurrent, conv)

        gate = gate_in if hasattr(self, "g_proj") else self.g_b_proj(gate_in)
        y = gated_rms_norm(o, gate.reshape(T, H, d), self.o_norm.weight, self.eps).to(x.dtype)
        return self.tp.all_reduce(self.o_proj(y.reshape(T, H * d)))

    def _attend(self, qkv_in: torch.Tensor, g: torch.Tensor, b: torch.Tensor, batch: ForwardBatch,
                recurrent: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
        """Conv and delta rule of a batch of decodes and prefills, advancing their slots: o [T, H, V]."""
        T, H, d = qkv_in.shape[0], self.num_heads, self.head_dim
        if batch.checkpoint_offsets is not None:
            self._checkpoint_conv(qkv_in, batch, conv)
        decode_only = batch.num_decode == batch.num_seqs
        qkv = causal_conv1d(qkv_in, self.conv_weight, conv, batch.cu_seqlens, batch.slot_ids, activation="silu",
                            pad_slot=batch.pad_slot, plan=None if decode_only else batch.kda_chunk_plan(CHUNK_SIZE))
        q, k, v = (t.reshape(T, H, d) for t in qkv.split(H * d, dim=-1))
        if decode_only and batch.checkpoint_offsets is None:  # chunked form emits checkpoints
            return kda_decode(q, k, v, g, b, recurrent, batch.slot_ids, use_qk_l2norm_in_kernel=True,
                              pad_slot=batch.pad_slot, use_beta_sigmoid_in_kernel=True)
        return self._chunked(q, k, v, g, torch.sigmoid(b.float()), batch, recurrent)  # beta [T, H]

    def _verify(self, qkv_in: torch.Tensor, g: torch.Tensor, b: torch.Tensor, batch: ForwardBatch,
                recurrent: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
        """The verify rows: decode steps from each slot, which stays as it was; the records join the batch's."""
        T, H, d = qkv_in.shape[0], self.num_heads, self.head_dim
        cu, slots = batch.spec_spans()
        qkv = conv_verify(qkv_in, self.conv_weight, conv, cu, slots, activation="silu")
        q, k, v = (t.reshape(T, H, d) for t in qkv.split(H * d, dim=-1))
        o, records = kda_verify(q, k, v, g, b, recurrent, slots, cu, use_qk_l2norm_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True)
        batch.verify_records.append(VerifyRecords(records, qkv_in.clone()))  # not a view: the projection is freed
        return o

    @staticmethod
    def commit_verified(records: VerifyRecords, recurrent: torch.Tensor, conv: torch.Tensor, slots: list[int],
                        cu_seqlens: list[int], commit_lens: list[int]) -> None:
        """RecoverSSM: each verify sequence's slot (state and conv window) advanced by its first commit_lens[n]
        tokens, as if they alone had been decoded."""
        kda_commit(recurrent, records.kda, slots, cu_seqlens, commit_lens)
        conv_commit(conv, records.conv_inputs, cu_seqlens, slots, commit_lens)

    def _chunked(self, q, k, v, g, beta, batch: ForwardBatch, recurrent: torch.Tensor) -> torch.Tensor:
        """One varlen chunked pass over every sequence; the state at the checkpoint offset comes
        out of the same pass (no second forward, no split of the chunk). Host indices and the batch's
        one chunk plan: nothing here reads a device value back."""
        o, final, checkpoints = chunk_kda(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
            initial_state=recurrent.index_select(0, batch.slot_ids),
            cu_seqlens=batch.cu_seqlens_host,
            checkpoint_offsets=batch.checkpoint_offsets_host,
            use_qk_l2norm_in_kernel=True,
            gate_lower_bound=self.lower_bound,  # K3 bounded gate: g >= lower_bound by construction
            plan=batch.kda_chunk_plan(CHUNK_SIZE),
        )
        recurrent.index_copy_(0, batch.slot_ids, final)
        if checkpoints is not None:
            rows = batch.checkpoint_rows
            recurrent.index_copy_(0, batch.checkpoint_slot_ids.index_select(0, rows), checkpoints.index_select(0, rows))
        return o.squeeze(0)

    @staticmethod
    def _checkpoint_conv(qkv_in: torch.Tensor, batch: ForwardBatch, conv: torch.Tensor) -> None:
        """Conv window at a checkpoint = the W-1 pre-conv inputs just before the offset, taken from
        the chunk itself and, for offsets < W-1, the tail of the window the sequence came in with.
        Offsets and slots are read from the batch's host copies (no device read-back)."""
        width = conv.shape[-1]
        offsets, targets = batch.checkpoint_offsets_host.tolist(), batch.checkpoint_slot_ids_host.tolist()
        starts = batch.cu_seqlens_host.tolist()
        for n, (off, dst, slot) in enumerate(zip(offsets, targets, batch.slot_ids_host.tolist())):
            if off < 0:
                continue
            end = starts[n] + off
            recent = qkv_in[max(end - width, starts[n]) : end].to(conv.dtype)  # [<= W-1, 3P]
            window = torch.cat([conv[slot].transpose(0, 1), recent])[-width:]  # oldest first
            conv[dst] = window.transpose(0, 1)
