"""A drafter on this device, loaded from its checkpoint directory and bound to the target's embedding and lm_head:
the target's own at TP 1, else full copies read from the target's checkpoint (the drafter runs on rank 0 alone).
A `draft_model` drafter is a K3 model of its own, loaded as the target is (unsharded)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from k3serve.model.draft.base import Drafter
from k3serve.model.draft.config import DrafterConfig
from k3serve.model.draft.dspark import DSparkDrafter
from k3serve.model.draft.eagle import EagleDrafter
from k3serve.model.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM
from k3serve.model.parallel import SINGLE
from k3serve.model.weights import WeightLoadError, checkpoint_files, load_weights

DRAFTERS: dict[str, type[Drafter]] = {"eagle": EagleDrafter, "dspark": DSparkDrafter}


def load_drafter(drafter_dir: str | Path, config: DrafterConfig, target: KimiForCausalLM, target_dir: str | Path,
                 device: torch.device | str) -> Drafter | KimiForCausalLM:
    """`config` (already checked against the target: `DrafterConfig.check_fits`) with its weights from
    `drafter_dir`, in the target's dtype, on `device`; a `draft_model` is a whole model, unsharded."""
    if config.method == "draft_model":
        model = load_model(drafter_dir, SINGLE, target.dtype, device)
        model.use_kernels(reference=target.reference_kernels)
        return model
    with torch.device(device):
        drafter = DRAFTERS[config.method](config, target.dtype)
    load_weights(drafter, drafter_dir)
    drafter.process_weights_after_loading()
    drafter.reference_kernels = target.reference_kernels
    if target.tp.world_size == 1:
        drafter.bind(target.model.embed_tokens, target.lm_head)
    else:
        drafter.bind(*_full_tables(target, target_dir, device))
    return drafter.eval()


def _full_tables(target: KimiForCausalLM, target_dir: str | Path, device: torch.device | str
                 ) -> tuple[VocabParallelEmbedding, ParallelLMHead]:
    config, prefix = target.config, target.config.weight_prefix
    with torch.device(device):
        embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, SINGLE, target.dtype)
        head = ParallelLMHead(config.vocab_size, config.hidden_size, SINGLE, target.dtype)
    wanted = {f"{prefix}model.embed_tokens.weight": embed.weight, f"{prefix}lm_head.weight": head.weight}
    for path in checkpoint_files(target_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in wanted.keys() & set(f.keys()):
                wanted.pop(name).data.copy_(f.get_tensor(name).to(target.dtype))
    if wanted:
        raise WeightLoadError(f"target checkpoint {target_dir} lacks {sorted(wanted)} for the drafter")
    return embed, head
