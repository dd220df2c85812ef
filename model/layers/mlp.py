"""Feed-forward blocks: the dense GLU MLP (layer 0, shared experts) and the (latent) MoE.

Dense MLPs are column/row parallel over the intermediate dim. Routed experts are expert
parallel: each rank holds experts [rank*E/tp, (rank+1)*E/tp) whole, so MXFP4 groups of 32 never
straddle a shard. In the latent MoE (K3) the routed partial sums are all-reduced in latent space
BEFORE the latent RMSNorm, because norm(sum) != sum(norm).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Literal

import torch

from k3serve.kernels.linear import linear
from k3serve.kernels.moe import ExpertWeights, fused_experts, select_experts, silu_glu, situ_glu
from k3serve.kernels.mxfp4 import MXFP4Tensor
from k3serve.model.config import ModelConfig
from k3serve.model.layers.common import Linear, RMSNorm, Sharded, project, stack_rows
from k3serve.model.parallel import TensorParallel

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def glu_activation(config: ModelConfig) -> Activation:
    if config.hidden_act == "situ":
        return partial(situ_glu, beta=config.situ_beta, linear_beta=config.situ_linear_beta)
    return silu_glu


class DenseMLP(Sharded):
    """down(act(gate(x), up(x))); returns this rank's partial sum (caller all-reduces).

    gate and up run as one GEMM over their stacked weights, unless `stack_gate_up` is False: then the
    owner stacks them with its own projections of the same input (SparseMoE's shared experts) and calls
    `output` with their results (`forward` still works: gate and up as GEMMs of their own)."""

    def __init__(self, hidden: int, intermediate: int, act: Activation, tp: TensorParallel, dtype: torch.dtype,
                 stack_gate_up: bool = True):
        super().__init__()
        _, local = tp.shard(intermediate, "MLP intermediate size")
        self.act = act
        self.gate_proj = Linear(hidden, local, dtype, tp_dim=0)
        self.up_proj = Linear(hidden, local, dtype, tp_dim=0)
        self.down_proj = Linear(local, hidden, dtype, tp_dim=1)
        self.stack_gate_up = stack_gate_up
        self.gate_up_weight = stack_rows(None, [self.gate_proj, self.up_proj]) if stack_gate_up else None

    def process_weights_after_loading(self) -> None:
        """gate_proj and up_proj stay stacked (`stack_rows`), or are stacked again if their parameters moved."""
        if self.stack_gate_up:
            self.gate_up_weight = stack_rows(self.gate_up_weight, [self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:  # stacked by the owner, with its own projections
            return self.output(self.gate_proj(x), self.up_proj(x))
        return self.output(*project(x, self.gate_up_weight, [self.gate_proj.weight.shape[0]] * 2))

    def output(self, gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """down(act(gate, up)) from the gate and up projections of the input; out_dtype (default the weights'
        dtype) may be fp32: the partial sum of a rank unrounded, as the all-reduce sums it."""
        return self.down_proj(self.act(gate, up), out_dtype=out_dtype)


class RoutedExperts(Sharded):
    """This rank's slice of the expert bank, stacked per projection.

    Checkpoint names `experts.{j}.{w1,w2,w3}.weight` (dense) or `.weight_packed` + `.weight_scale`
    (MXFP4, kept packed in memory) load into row j - expert_start of the stacks.
    """

    PROJ_SHAPES = {"w1": ("inter", "dim"), "w3": ("inter", "dim"), "w2": ("dim", "inter")}

    def __init__(self, num_experts: int, dim: int, inter: int, mxfp4: bool, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        self.expert_start, self.num_local = tp.shard(num_experts, "num_experts")
        self.mxfp4 = mxfp4
        sizes = {"inter": inter, "dim": dim}
        for proj, (out_key, in_key) in self.PROJ_SHAPES.items():
            out_f, in_f = sizes[out_key], sizes[in_key]
            if mxfp4:
                self.register_buffer(f"{proj}_packed", torch.empty(self.num_local, out_f, in_f // 2, dtype=torch.uint8))
                self.register_buffer(f"{proj}_scale", torch.empty(self.num_local, out_f, in_f // 32, dtype=torch.uint8))
            else:
                self.register_buffer(f"{proj}_weight", torch.empty(self.num_local, out_f, in_f, dtype=dtype))

    def checkpoint_entries(self) -> dict[str, str]:
        """Local checkpoint suffix (`{j}.w1.weight_packed`) -> buffer name, for this rank's experts."""
        kinds = {"packed": "weight_packed", "scale": "weight_scale"} if self.mxfp4 else {"weight": "weight"}
        return {
            f"{j}.{proj}.{ckpt}": f"{proj}_{kind}"
            for j in range(self.expert_start, self.expert_start + self.num_local)
            for proj in self.PROJ_SHAPES
            for kind, ckpt in kinds.items()
        }

    def weights(self) -> ExpertWeights:
        if self.mxfp4:
            w = {p: MXFP4Tensor(getattr(self, f"{p}_packed"), getattr(self, f"{p}_scale")) for p in self.PROJ_SHAPES}
        else:
            w = {p: getattr(self, f"{p}_weight") for p in self.PROJ_SHAPES}
        return ExpertWeights(w1=w["w1"], w3=w["w3"], w2=w["w2"])


class MoEGate(Sharded):
    """Router: sigmoid scores in fp32; the correction bias only steers selection."""

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = self.add_param("weight", (num_experts, hidden), dtype, None)
        self.e_score_correction_bias = self.add_param("e_score_correction_bias", (num_experts,), torch.float32, None)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 [T, E]: the exact products of x and the weight in their own dtype, summed in fp32 (no fp32
        copy of the weight: K3 kept 1.4 GiB of them a rank, and read twice the bytes each step)."""
        return linear(x, self.weight, out_dtype=torch.float32)


class SparseMoE(Sharded):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp, self.config = tp, config
        self.act = glu_activation(config)
        self.finalize: Literal["fused", "unfused"] = "fused"  # the routed experts' top-k sum (kernels.moe)
        hidden, latent = config.hidden_size, config.routed_expert_hidden_size
        self.gate = MoEGate(hidden, config.num_experts, dtype)
        if latent is not None:
            self.routed_expert_down_proj = Linear(hidden, latent, dtype)
            self.routed_expert_up_proj = Linear(latent, hidden, dtype)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(latent, config.rms_norm_eps, dtype)
        self.experts = RoutedExperts(
            config.num_experts, latent or hidden, config.moe_intermediate_size, config.experts_mxfp4, tp, dtype
        )
        if config.shared_intermediate:
            self.shared_experts = DenseMLP(hidden, config.shared_intermediate, self.act, tp, dtype, stack_gate_up=False)
        # the latent down-projection and the shared experts' gate and up all read x: one GEMM
        self._x_proj_sizes = [proj.weight.shape[0] for proj in self._projections_of_x()]
        self.x_proj_weight = stack_rows(None, self._projections_of_x()) if self._x_proj_sizes else None

    def _projections_of_x(self) -> list[Linear]:
        """Those of routed_expert_down_proj, shared gate_proj, shared up_proj that the layer has (the
        router is not among them: its logits are fp32)."""
        down = [self.routed_expert_down_proj] if hasattr(self, "routed_expert_down_proj") else []
        shared = [self.shared_experts.gate_proj, self.shared_experts.up_proj] if hasattr(self, "shared_experts") else []
        return down + shared

    def process_weights_after_loading(self) -> None:
        """The projections of x stay stacked (`stack_rows`), or are stacked again if their parameters moved."""
        if self._x_proj_sizes:
            self.x_proj_weight = stack_rows(self.x_proj_weight, self._projections_of_x())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        weights, ids = select_experts(
            self.gate.logits(x), self.gate.e_score_correction_bias, cfg.num_experts_per_token,
            cfg.moe_renormalize, cfg.routed_scaling_factor,
        )
        is_latent = cfg.routed_expert_hidden_size is not None
        projected = list(project(x, self.x_proj_weight, self._x_proj_sizes)) if self._x_proj_sizes else []
        expert_in = projected.pop(0) if is_latent else x
        routed = fused_experts(expert_in, self.experts.weights(), weights, ids, self.act, self.experts.expert_start,
                               self.finalize)
        if not is_latent:  # one all-reduce for routed + shared partial sums (fp32: routed's dtype)
            shared = self.shared_experts.output(*projected) if projected else None
            return self.tp.all_reduce(routed if shared is None else routed + shared).to(x.dtype)
        # the shared experts' partial sums in fp32 straight from their down-projection, all-reduced so, then
        # added to the up-projection's fp32 sums: no cast and no add of their own, one rounding for both
        shared = self.shared_experts.output(*projected, out_dtype=torch.float32) if projected else None
        routed = self.tp.all_reduce(routed)  # sum the experts of every rank in latent space ...
        if cfg.latent_moe_use_norm:
            routed = self.routed_expert_norm(routed, out_dtype=x.dtype)  # ... then normalize, into x's dtype
        return self.routed_expert_up_proj(routed, add=None if shared is None else self.tp.all_reduce(shared))
