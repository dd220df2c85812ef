"""The K3 model as a trainable full-sequence module: [B, T] token ids -> [B, T, vocab] logits, differentiable.

The engine's layers (model/layers/) are inference-only: paged caches written in place, stacked projections, packed
MXFP4 experts, `torch.inference_mode`. This module is the same math over whole sequences from a zero state, with
the parameters named as the checkpoint names them (`model.layers.N.self_attn.q_proj.weight`; the routed experts
stacked [E, out, in] until `export.py` writes them one by one), and it calls the kernels' fp32 references where
they are differentiable (gate, norms, SiTU, routing, the attention-residual mix). What it does itself:

* KDA's delta rule in the chunked WY form (`chunk_delta_rule`: kernels/kda/naive.py's chunk form with a batch
  dim, no cache), after a causal depthwise conv;
* MLA's MHA form with `scaled_dot_product_attention` (NoPE, one shared k_pe, scale (nope + rope)^-1/2);
* the routed experts evaluated for every token and combined with the router's top-k weights (zero elsewhere):
  the same sum as the engine's sparse form, without scatter or index_add (deterministic on a GPU).

tests/tools/test_train_model.py holds its logits equal to the engine's (`model/score.py`) on the same weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3serve.kernels.attn_res.naive import attn_res_aggregate
from k3serve.kernels.kda.naive import kda_gate
from k3serve.kernels.moe.naive import select_experts, situ_glu
from k3serve.kernels.mxfp4.naive import dequantize_mxfp4, quantize_mxfp4
from k3serve.kernels.norm.naive import gated_rms_norm, l2_normalize, rms_norm
from k3serve.model.config import ModelConfig


class Weight(nn.Module):
    """One checkpoint tensor `<name>.weight`, drawn with standard deviation `std` (default 1/sqrt(fan-in))."""

    def __init__(self, *shape: int, std: float | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*shape) * (1 / math.sqrt(shape[-1]) if std is None else std))


def norm_weight(size: int) -> Weight:
    """An RMSNorm weight: ones."""
    norm = Weight(size, std=0.0)
    nn.init.ones_(norm.weight)
    return norm


def chunk_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk: int) -> Tensor:
    """KDA from a zero state: q (pre-scaled), k, g [B, H, T, K], v [B, H, T, V], beta [B, H, T] -> o [B, H, T, V].

    Per chunk (cumulative log decay G over it): T = (I + strictly-lower(beta_i k_i.(k_j e^{G_i - G_j})))^-1 diag(beta),
    w = T (e^G k), u = T v, v_new = u - w S, o = (q e^G) S + (q.(k e^{G_i - G_j}))_{j<=i} v_new, then the state moves
    to the chunk's end (kernels/kda/naive.py `_chunk_sequence`, the same formulas). Everything but the state's walk
    runs for all chunks at once (T padded to whole chunks with tokens that change nothing: k = v = beta = g = 0), so
    a step launches a few kernels a chunk."""
    B, H, L, K = q.shape
    pad = -L % chunk
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (L + pad) // chunk
    qc, kc, vc, gc = (t.reshape(B, H, N, chunk, t.shape[-1]) for t in (q, k, v, g))
    bc = beta.reshape(B, H, N, chunk)
    G = gc.cumsum(3)  # [B, H, N, c, K]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    Akk = (((kc[..., :, None, :] * kc[..., None, :, :]) * decay).sum(-1) * bc[..., None]).tril(-1)
    eye = torch.eye(chunk, device=q.device)
    T = torch.linalg.solve_triangular(eye + Akk, torch.diag_embed(bc), upper=False)
    w, u = T @ (G.exp() * kc), T @ vc  # [B, H, N, c, K | V]
    Aqk = ((qc[..., :, None, :] * kc[..., None, :, :]) * decay).sum(-1)  # [B, H, N, c, c], j <= i
    q_decayed = qc * G.exp()
    G_end = G[..., -1, :]  # [B, H, N, K]
    k_to_end = ((G_end[..., None, :] - G).exp() * kc).transpose(-1, -2)  # [B, H, N, K, c]
    end_decay = G_end.exp()[..., None]  # [B, H, N, K, 1]
    S = q.new_zeros(B, H, K, v.shape[-1])
    outputs = []
    # unbind, not indexing: its backward is one stack, where an index's is a zero-filled copy a chunk
    for u_n, w_n, q_n, a_n, d_n, k_n in zip(*(t.unbind(2) for t in (u, w, q_decayed, Aqk, end_decay, k_to_end))):
        v_new = u_n - w_n @ S
        outputs.append(q_n @ S + a_n @ v_new)
        S = d_n * S + k_n @ v_new
    return torch.stack(outputs, dim=2).reshape(B, H, N * chunk, -1)[:, :, :L]


class KDA(nn.Module):
    """`self_attn` of a KDA layer (model/K3_MODEL.md §1d), K3 form: bounded gate, full-rank output gate."""

    def __init__(self, config: ModelConfig, chunk: int) -> None:
        super().__init__()
        kda, D = config.kda, config.hidden_size
        self.H, self.d, self.chunk = kda.num_heads, kda.head_dim, chunk
        self.lower_bound, self.eps = kda.gate_lower_bound, config.rms_norm_eps
        P, W = self.H * self.d, kda.conv_kernel_size
        self.q_proj, self.k_proj, self.v_proj = Weight(P, D), Weight(P, D), Weight(P, D)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (Weight(P, 1, W) for _ in range(3))
        self.f_a_proj, self.f_b_proj = Weight(self.d, D), Weight(P, self.d)
        self.b_proj = Weight(self.H, D)
        # decay rates spread from fast to slow at the start: g = lower_bound * sigmoid(f + dt_bias), dt_bias < 0
        self.A_log = nn.Parameter(torch.zeros(self.H))
        self.dt_bias = nn.Parameter(torch.empty(P).uniform_(-6.0, 0.0))
        self.g_proj = Weight(P, D)
        self.o_norm = norm_weight(self.d)
        self.o_proj = Weight(D, P, std=1 / math.sqrt(P * config.num_hidden_layers))

    def _conv(self, x: Tensor, conv: Weight) -> Tensor:
        """silu of the causal depthwise conv over time: x [B, T, P] -> [B, T, P]."""
        W = conv.weight.shape[-1]
        y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), conv.weight, groups=conv.weight.shape[0])
        return F.silu(y).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        H, d = self.H, self.d
        heads = lambda t: t.reshape(B, L, H, -1).transpose(1, 2)  # noqa: E731  [B, H, L, d]
        q = l2_normalize(self._conv(x @ self.q_proj.weight.T, self.q_conv1d).reshape(B, L, H, d)) * d**-0.5
        k = l2_normalize(self._conv(x @ self.k_proj.weight.T, self.k_conv1d).reshape(B, L, H, d))
        v = self._conv(x @ self.v_proj.weight.T, self.v_conv1d)
        f = (x @ self.f_a_proj.weight.T) @ self.f_b_proj.weight.T
        g = kda_gate(f.reshape(B, L, H, d), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(x @ self.b_proj.weight.T).transpose(1, 2)  # [B, H, L]
        o = chunk_delta_rule(q.transpose(1, 2), k.transpose(1, 2), heads(v), g.transpose(1, 2), beta, self.chunk)
        gate = (x @ self.g_proj.weight.T).reshape(B, L, H, d)
        y = gated_rms_norm(o.transpose(1, 2), gate, self.o_norm.weight, self.eps)
        return y.reshape(B, L, H * d) @ self.o_proj.weight.T


class MLA(nn.Module):
    """`self_attn` of an MLA layer (model/K3_MODEL.md §1c), K3 form: q LoRA, NoPE, sigmoid output gate."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.H, self.v_dim = H, config.v_head_dim
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.latent, self.eps, self.scale = config.kv_lora_rank, config.rms_norm_eps, config.qk_head_dim**-0.5
        self.q_a_proj = Weight(config.q_lora_rank, D)
        self.q_a_layernorm = norm_weight(config.q_lora_rank)
        self.q_b_proj = Weight(H * config.qk_head_dim, config.q_lora_rank)
        self.kv_a_proj_with_mqa = Weight(config.mla_kv_dim, D)
        self.kv_a_layernorm = norm_weight(self.latent)
        self.kv_b_proj = Weight(H * (self.nope + self.v_dim), self.latent)
        self.g_proj = Weight(H * self.v_dim, D)
        self.o_proj = Weight(D, H * self.v_dim, std=1 / math.sqrt(H * self.v_dim * config.num_hidden_layers))

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, L, D] -> q, k [B, H, L, nope + rope], v [B, H, L, v_dim] (no positions: NoPE)."""
        B, L, _ = x.shape
        H = self.H
        q_a = rms_norm(x @ self.q_a_proj.weight.T, self.q_a_layernorm.weight, self.eps)
        q = (q_a @ self.q_b_proj.weight.T).reshape(B, L, H, -1).transpose(1, 2)
        kv_a = x @ self.kv_a_proj_with_mqa.weight.T
        c = rms_norm(kv_a[..., : self.latent], self.kv_a_layernorm.weight, self.eps)
        kv = (c @ self.kv_b_proj.weight.T).reshape(B, L, H, -1).transpose(1, 2)
        k_pe = kv_a[..., self.latent :].unsqueeze(1).expand(B, H, L, self.rope)
        return q, torch.cat([kv[..., : self.nope], k_pe], dim=-1), kv[..., self.nope :]

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """The attention's output o [B, H, L, v_dim] through the sigmoid gate of x [B, L, D] and o_proj."""
        B, H, L, V = o.shape
        return (o.transpose(1, 2).reshape(B, L, H * V) * torch.sigmoid(x @ self.g_proj.weight.T)) @ self.o_proj.weight.T

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x)
        return self.output(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale), x)


class MLP(nn.Module):
    """down(SiTU-GLU(gate x, up x)): the dense first layer's `mlp` and the MoE's `shared_experts`."""

    def __init__(self, hidden: int, inter: int, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = Weight(inter, hidden), Weight(inter, hidden)
        self.down_proj = Weight(hidden, inter, std=1 / math.sqrt(inter * config.num_hidden_layers))
        self.beta, self.linear_beta = config.situ_beta, config.situ_linear_beta

    def forward(self, x: Tensor) -> Tensor:
        act = situ_glu(x @ self.gate_proj.weight.T, x @ self.up_proj.weight.T, self.beta, self.linear_beta)
        return act @ self.down_proj.weight.T


class Experts(nn.Module):
    """The routed experts stacked: w1 (gate), w3 (up) [E, I, L], w2 (down) [E, L, I]."""

    def __init__(self, num: int, dim: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num, inter, dim) / math.sqrt(dim))
        self.w3 = nn.Parameter(torch.randn(num, inter, dim) / math.sqrt(dim))
        self.w2 = nn.Parameter(torch.randn(num, dim, inter) / math.sqrt(inter))
        self.fake_quant = False  # QAT: train through MXFP4 rounding (straight-through)

    def weights(self) -> tuple[Tensor, Tensor, Tensor]:
        if not self.fake_quant:
            return self.w1, self.w3, self.w2
        weights = (self.w1, self.w3, self.w2)
        return tuple(w + (dequantize_mxfp4(*quantize_mxfp4(w.detach())) - w).detach() for w in weights)


class MoE(nn.Module):
    """`block_sparse_moe`: sigmoid router with the noaux_tc correction bias (moved by `balance`, not by gradients),
    latent down-projection, routed experts, latent RMSNorm, up-projection, plus the shared experts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D, latent, E = config.hidden_size, config.routed_expert_hidden_size, config.num_experts
        self.config = config
        self.gate = Weight(E, D)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(E), requires_grad=False)
        self.routed_expert_down_proj = Weight(latent, D)
        self.routed_expert_up_proj = Weight(D, latent, std=1 / math.sqrt(latent * config.num_hidden_layers))
        self.routed_expert_norm = norm_weight(latent)
        self.experts = Experts(E, latent, config.moe_intermediate_size)
        self.shared_experts = MLP(D, config.shared_intermediate, config)
        self.load: Tensor | None = None  # tokens a expert got in the last forward, for `balance`

    def forward(self, x: Tensor) -> Tensor:
        cfg, shape = self.config, x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = select_experts(x @ self.gate.weight.T, self.gate.e_score_correction_bias,
                                      cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)
        self.load = torch.bincount(ids.flatten(), minlength=cfg.num_experts).float()
        combine = torch.zeros(x.shape[0], cfg.num_experts, device=x.device).scatter(1, ids, weights)  # [N, E]
        w1, w3, w2 = self.experts.weights()
        E, inter, latent = w1.shape
        h = x @ self.routed_expert_down_proj.weight.T  # [N, latent]
        gate, up = ((h @ w.reshape(E * inter, latent).T).reshape(-1, E, inter) for w in (w1, w3))
        act = situ_glu(gate, up, cfg.situ_beta, cfg.situ_linear_beta) * combine[..., None]  # [N, E, I]
        routed = act.reshape(-1, E * inter) @ w2.transpose(1, 2).reshape(E * inter, latent)  # one GEMM over experts
        routed = rms_norm(routed, self.routed_expert_norm.weight, cfg.rms_norm_eps)
        out = routed @ self.routed_expert_up_proj.weight.T + self.shared_experts(x)
        return out.reshape(shape)

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded."""
        if self.load is not None:
            self.gate.e_score_correction_bias += rate * torch.sign(self.load.mean() - self.load)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, idx: int, chunk: int) -> None:
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.idx, self.block, self.eps = idx, config.attn_res_block_size, eps
        self.input_layernorm, self.post_attention_layernorm = norm_weight(D), norm_weight(D)
        self.self_attn = KDA(config, chunk) if config.is_kda_layer(idx) else MLA(config)
        if config.is_moe_layer(idx):
            self.block_sparse_moe = MoE(config)
        else:
            self.mlp = MLP(D, config.intermediate_size, config)
        # zero score projections: an even mix of the sources at the start
        self.self_attention_res_proj, self.self_attention_res_norm = Weight(1, D, std=0.0), norm_weight(D)
        self.mlp_res_proj, self.mlp_res_norm = Weight(1, D, std=0.0), norm_weight(D)

    def forward(self, sources: list[Tensor]) -> list[Tensor]:
        """Attention residuals (model/K3_MODEL.md §1f): `sources` is the bank then the running block sum."""
        x = _mix(sources, self.self_attention_res_proj, self.self_attention_res_norm, self.input_layernorm, self.eps)
        a = self.self_attn(x)
        sources = sources + [a] if self.idx % self.block == 0 else sources[:-1] + [sources[-1] + a]
        x = _mix(sources, self.mlp_res_proj, self.mlp_res_norm, self.post_attention_layernorm, self.eps)
        m = self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)
        return sources[:-1] + [sources[-1] + m]


def _mix(sources: list[Tensor], proj: Weight, res_norm: Weight, out_norm: Weight, eps: float) -> Tensor:
    score = res_norm.weight * proj.weight.reshape(-1)  # kernels.attn_res.fold_score_weight
    return attn_res_aggregate(torch.stack(sources), score, eps, out_norm.weight, eps)


class KimiModel(nn.Module):
    def __init__(self, config: ModelConfig, chunk: int) -> None:
        super().__init__()
        D = config.hidden_size
        self.embed_tokens = Weight(config.vocab_size, D, std=1.0)
        self.layers = nn.ModuleList(DecoderLayer(config, i, chunk) for i in range(config.num_hidden_layers))
        self.norm = norm_weight(D)
        self.output_attn_res_proj, self.output_attn_res_norm = Weight(1, D, std=0.0), norm_weight(D)
        self.eps = config.rms_norm_eps

    def forward(self, token_ids: Tensor) -> Tensor:
        sources = [F.embedding(token_ids, self.embed_tokens.weight)]
        for layer in self.layers:
            sources = layer(sources)
        return _mix(sources, self.output_attn_res_proj, self.output_attn_res_norm, self.norm, self.eps)


class TrainableK3(nn.Module):
    """`model.*` + `lm_head`, with the engine's names; fp32 parameters."""

    def __init__(self, config: ModelConfig, chunk: int = 32) -> None:
        super().__init__()
        if not config.attn_res_block_size or config.routed_expert_hidden_size is None or not config.num_shared_experts:
            raise ValueError("the trainer builds K3 models: attention residuals, latent MoE and shared experts")
        if config.kda.gate_lower_bound is None or not config.kda.use_full_rank_gate or config.q_lora_rank is None \
                or not config.mla_use_output_gate or config.hidden_act != "situ":
            raise ValueError("the trainer builds K3 models: bounded KDA gate, full-rank gates, q LoRA, SiTU")
        self.config = config
        self.model = KimiModel(config, chunk)
        self.lm_head = Weight(config.vocab_size, config.hidden_size, std=0.25 / math.sqrt(config.hidden_size))

    def forward(self, token_ids: Tensor) -> Tensor:
        """[B, T] -> fp32 logits [B, T, vocab]."""
        return self.model(token_ids) @ self.lm_head.weight.T

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def set_fake_quant(self, enabled: bool) -> None:
        """Run the routed experts through MXFP4 rounding (QAT, and the quantised model's evaluation)."""
        for moe in self.moe_layers():
            moe.experts.fake_quant = enabled
