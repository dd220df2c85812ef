"""Decode context parallelism on the GPU: each rank's Triton decode over its pages, merged by the Triton LSE merge,
equals the fp32 reference of the unsplit decode (bf16 cache, NaN in every row no rank may read); and each rank's
Triton cache write through `local_slots` lands only its own pages."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels import mla
from k3serve.kernels.mla import dcp, mla_decode_dcp, naive, write_kv_cache

from _close import assert_rel_rms
from _mla_cases import paged_decode_case

pytestmark = pytest.mark.gpu

L, R, PAGE = 512, 64, 64
SCALE = 192**-0.5
TOL = 1e-2
CASES = {  # name: (seq_lens, heads: the DCP group's, W)
    "B1-32K-H64-W8": ([32768], 64, 8),
    "B6-edges-H16-W2": ([1, 63, 64, 65, 0, 5000], 16, 2),
    "B5-edges-H32-W4": ([255, 256, 257, 1000, 511], 32, 4),
    "B16-8K-H64-W8": ([8192 - 37 * i for i in range(16)], 64, 8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_and_merge_match_the_unsplit_reference(case: str) -> None:
    seq_lens, heads, W = CASES[case]
    q_latent, q_pe, kv, tables, lens = paged_decode_case(seq_lens, heads, L, R, W * PAGE, torch.bfloat16, "cuda")
    o, lse = mla_decode_dcp(q_latent, q_pe, kv, tables, lens, SCALE, L, W)
    assert mla.last_backend["mla_decode_paged"] == mla.last_backend["merge_attn_states"] == "triton"
    ref_o, ref_lse = naive.mla_decode_paged(q_latent, q_pe, kv, tables, lens, SCALE, L)
    assert_rel_rms("o_latent", ref_o.float(), o.float(), TOL)
    full = lens > 0
    assert (lse[full] - ref_lse[full]).abs().max() < 1e-2
    assert torch.isinf(lse[~full]).all() and (o[~full] == 0).all()


@pytest.mark.parametrize("W", [2, 8])
def test_each_rank_writes_only_its_pages(W: int) -> None:
    blocks, span = 5, W * PAGE
    slots = torch.randperm(blocks * span, device="cuda")[: 3 * span]
    latent = torch.randn(slots.shape[0], L + R, device="cuda").bfloat16()
    full = torch.full((blocks, span, L + R), float("nan"), device="cuda", dtype=torch.bfloat16)
    write_kv_cache(full, slots, latent)
    for r, shard in enumerate(dcp.shard_cache(full, W)):
        mine = torch.full((blocks, PAGE, L + R), float("nan"), device="cuda", dtype=torch.bfloat16)
        write_kv_cache(mine, dcp.local_slots(slots, PAGE, W, r), latent)
        assert mla.last_backend["write_kv_cache"] == "triton"
        assert torch.equal(mine.isnan(), shard.isnan())
        assert torch.equal(mine.nan_to_num(0), shard.nan_to_num(0))
