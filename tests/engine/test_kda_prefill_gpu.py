"""KDA prefill on the GPU through the model layer, as the runner feeds it: no host sync (`K3_TINY_GPU`: KDA
12 x 128 heads, bf16, so fla's chunked kernels run).

One mixed step built by `ForwardBatch.build`: two decodes, a fresh 150-token prefill checkpointed mid-chunk
(at 77), a 64-token chunk continuing 20 cached tokens checkpointed at 2 (its conv window reaches back
into the window it came in with) and a 40-token chunk without one. Once compiled, `KimiDeltaAttention`
on a freshly built batch (so its chunk plan is built inside the forward) runs under CUDA's sync debug
mode "error", which raises at a host sync: the conv, the chunk plan, chunk_kda, the state write-back and
both checkpoints (state and conv window) read nothing back from the device. It matches the same layer
with the torch reference forced (fp32 KDA), within the bf16 tolerance of the KDA kernel tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3serve.kernels import _backend, kda
from k3serve.model.batch import ForwardBatch, ModelCache
from k3serve.model.layers.kda import KimiDeltaAttention
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM

pytestmark = pytest.mark.gpu

BLOCK, NUM_BLOCKS, NUM_SLOTS = 16, 32, 12
TOL = 1e-2  # relative RMS: bf16 q, k, v and fla's bf16 chunk states (as tests/kernels/test_kda_gpu.py)
# (new tokens, cached tokens, slot, checkpoint offset, checkpoint slot): decodes first, as the runner packs
SEQS = [(1, 9, 4, -1, -1), (1, 30, 7, -1, -1), (150, 0, 0, 77, 9), (64, 20, 2, 2, 10), (40, 0, 5, -1, -1)]


@pytest.fixture(scope="module")
def model(k3_tiny_gpu_checkpoint: Path) -> KimiForCausalLM:
    return load_model(k3_tiny_gpu_checkpoint, dtype=torch.bfloat16, device="cuda")


def _batch() -> ForwardBatch:
    tokens, computed, tables, slots, offsets, targets, first = [], [], [], [], [], [], 0
    for new, cached, slot, offset, target in SEQS:
        num_blocks = -(-(new + cached) // BLOCK)
        tokens.append([0] * new)
        computed.append(cached)
        tables.append(list(range(first, first + num_blocks)))
        first += num_blocks
        slots.append(slot)
        offsets.append(offset)
        targets.append(target)
    return ForwardBatch.build(tokens, computed, tables, slots, BLOCK, checkpoint_offsets=offsets,
                              checkpoint_slot_ids=targets, device="cuda")


def _pools(model: KimiForCausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached sequences hold random states, fresh ones zeros (the runner zeroes them), every other slot
    (the checkpoint targets among them) NaN: a checkpoint must write its whole slot."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    cache = ModelCache.allocate(model.config, NUM_BLOCKS, NUM_SLOTS, BLOCK, dtype=torch.bfloat16, device="cuda")
    recurrent, conv = cache.kda_recurrent[0], cache.kda_conv[0]
    recurrent.fill_(float("nan"))
    conv.fill_(float("nan"))
    for _, cached, slot, _, _ in SEQS:
        recurrent[slot] = 0.1 * torch.randn(recurrent.shape[1:], device="cuda", generator=gen) if cached else 0
        conv[slot] = torch.randn(conv.shape[1:], device="cuda", generator=gen).to(conv.dtype) if cached else 0
    return recurrent, conv


def _rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def test_mixed_prefill_with_checkpoints_never_syncs(model: KimiForCausalLM) -> None:
    layer: KimiDeltaAttention = next(m.self_attn for m in model.model.layers if m.is_kda)
    x = torch.randn(sum(s[0] for s in SEQS), model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    pools = _pools(model)

    warm = [p.clone() for p in pools]
    layer(x, _batch(), *warm)  # compile / autotune (these do sync)
    batch, (recurrent, conv) = _batch(), [p.clone() for p in pools]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x, batch, recurrent, conv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kda.last_backend["chunk_kda"] == "fla"

    ref_recurrent, ref_conv = [p.clone() for p in pools]
    with _backend.reference_kernels():
        ref = layer(x, _batch(), ref_recurrent, ref_conv)
    assert kda.last_backend["chunk_kda"] == "naive"
    written = [s[2] for s in SEQS] + [s[4] for s in SEQS if s[4] >= 0]
    assert _rel_rms(ref, out) < TOL
    for slot in written:
        assert torch.isfinite(recurrent[slot]).all() and torch.isfinite(conv[slot]).all(), f"slot {slot}"
        assert _rel_rms(ref_recurrent[slot], recurrent[slot]) < TOL, f"recurrent state of slot {slot}"
        assert _rel_rms(ref_conv[slot], conv[slot]) < TOL, f"conv window of slot {slot}"
    untouched = [s for s in range(NUM_SLOTS) if s not in written]
    assert torch.isnan(recurrent[untouched]).all() and torch.isnan(conv[untouched]).all()
