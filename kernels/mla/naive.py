"""Plain-torch MLA attention (fp32 math): MHA-form prefill, paged latent cache, absorbed decode and
LSE merge (model/K3_MODEL.md §1c, §6). LSEs are natural-log throughout."""

from __future__ import annotations

import torch
from torch import Tensor

from .._backend import to_device_async
from . import dcp


def mla_prefill_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float
) -> Tensor:
    """Per sequence, the q_len queries are the last q_len of its k_len positions (chunked prefill)."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)  # [Tq, H, Dv]
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        q_len, k_len = q1 - q0, k1 - k0
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k[k0:k1].float()) * scale  # [H, q_len, k_len]
        q_pos = torch.arange(k_len - q_len, k_len, device=q.device)  # absolute position of each query
        visible = torch.arange(k_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, k_len]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v[k0:k1].float()).to(q.dtype)
    return out


def write_kv_cache(kv_cache: Tensor, slot_mapping: Tensor, latent: Tensor) -> None:
    """kv_cache[slot // block_size, slot % block_size] = latent, skipping slot -1."""
    block_size = kv_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kv_cache[slots // block_size, slots % block_size] = latent[keep].to(kv_cache.dtype)


def gather_kv_cache(kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor) -> tuple[Tensor, Tensor]:
    """Token p of sequence n sits at block block_tables[n, p // block_size], offset p % block_size."""
    block_size, device = kv_cache.shape[1], kv_cache.device
    cu_seqlens = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int64, device=seq_lens.device)
    cu_seqlens[1:] = torch.cumsum(seq_lens, dim=0)
    total = None if seq_lens.is_cuda else int(cu_seqlens[-1])  # known on the host: no read-back below
    cu = to_device_async(cu_seqlens, device)  # every MLA layer's prefill, once a group of sequences
    lens = cu.diff()
    seq_ids = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens, output_size=total)  # [total]
    pos = torch.arange(seq_ids.shape[0], device=device) - cu[seq_ids]  # [total]
    blocks = block_tables.to(device=device, dtype=torch.int64)[seq_ids, pos // block_size]  # [total]
    packed = kv_cache[blocks, pos % block_size]  # [total, L+R]
    return packed, cu_seqlens


def mla_decode_paged(
    q_latent: Tensor,
    q_pe: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[Tensor, Tensor]:
    """MQA over the latent cache: K = [c | k_pe], V = c. An empty sequence yields o = 0, lse = -inf."""
    num_seqs, num_heads, _ = q_latent.shape
    packed, cu_seqlens = gather_kv_cache(kv_cache, block_tables, seq_lens)
    o_latent = torch.zeros(num_seqs, num_heads, kv_lora_rank, dtype=torch.float32, device=q_latent.device)
    lse = torch.full((num_seqs, num_heads), float("-inf"), dtype=torch.float32, device=q_latent.device)
    bounds = cu_seqlens.tolist()
    for n in range(num_seqs):
        if bounds[n + 1] == bounds[n]:
            continue
        kv = packed[bounds[n] : bounds[n + 1]].float()  # [S, L+R]
        c, k_pe = kv[:, :kv_lora_rank], kv[:, kv_lora_rank:]
        scores = (q_latent[n].float() @ c.T + q_pe[n].float() @ k_pe.T) * scale  # [H, S]
        lse[n] = torch.logsumexp(scores, dim=-1)
        o_latent[n] = torch.exp(scores - lse[n, :, None]) @ c
    return o_latent.to(q_latent.dtype), lse


def merge_attn_states(outputs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """lse = log Σ_p exp(lse_p), o = Σ_p exp(lse_p - lse) o_p; empty parts (lse_p = -inf) add exactly 0."""
    lses = lses.float()  # [P, N, H]
    max_lse = lses.amax(dim=0)  # [N, H]
    shift = torch.where(torch.isinf(max_lse), torch.zeros_like(max_lse), max_lse)  # all parts empty -> 0
    part_weights = torch.exp(lses - shift)  # [P, N, H]; -inf parts -> 0, the max part -> 1
    total = part_weights.sum(dim=0)  # [N, H]; >= 1 unless every part is empty
    lse = shift + torch.log(total)  # all empty: log 0 = -inf
    coef = part_weights / total  # 0/0 only where every part is empty, and masked out below
    # where() rather than a product, so an empty part's garbage output (even NaN) cannot leak in.
    contrib = torch.where(part_weights[..., None] > 0, coef[..., None] * outputs.float(), 0.0)  # [P, N, H, D]
    return contrib.sum(dim=0).to(outputs.dtype), lse


def mla_decode_dcp(
    q_latent: Tensor,
    q_pe: Tensor,
    kv_cache: Tensor,  # [num_blocks, W * page, L+R]: virtual blocks, rank r's page r of each
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    kv_lora_rank: int,
    dcp_size: int,
) -> tuple[Tensor, Tensor]:
    """`mla_decode_paged` split over `dcp_size` ranks by page and merged by LSE: the reference of the DCP step."""
    return dcp.split_decode(mla_decode_paged, merge_attn_states, q_latent, q_pe, kv_cache, block_tables, seq_lens,
                            scale, kv_lora_rank, dcp_size)


def mla_verify_paged(
    q_latent: Tensor,  # [T, H, L]: the verify rows of N sequences, packed
    q_pe: Tensor,  # [T, H, R]
    kv_cache: Tensor,
    block_tables: Tensor,  # [N, max_blocks]
    seq_lens: list[int],  # [N]: cached tokens including every verify row
    cu_q: list[int],  # [N+1]
    scale: float,
    kv_lora_rank: int,
) -> Tensor:
    """`mla_decode_paged` for q_len rows a sequence, causal among them: row i of a sequence sees its first
    seq_len - (q_len - 1 - i) keys. Each sequence's latent KV is gathered once; each row computes exactly the
    decode of that length (the same products over the same rows)."""
    T, H, _ = q_latent.shape
    o_latent = torch.zeros(T, H, kv_lora_rank, dtype=torch.float32, device=q_latent.device)
    packed, cu_k = gather_kv_cache(kv_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int64))
    bounds = cu_k.tolist()
    for n in range(len(seq_lens)):
        kv_all = packed[bounds[n] : bounds[n + 1]].float()  # [S, L+R]
        q_len = cu_q[n + 1] - cu_q[n]
        for i, row in enumerate(range(cu_q[n], cu_q[n + 1])):
            kv = kv_all[: seq_lens[n] - (q_len - 1 - i)]
            c, k_pe = kv[:, :kv_lora_rank], kv[:, kv_lora_rank:]
            scores = (q_latent[row].float() @ c.T + q_pe[row].float() @ k_pe.T) * scale  # [H, S]
            lse = torch.logsumexp(scores, dim=-1)
            o_latent[row] = torch.exp(scores - lse[:, None]) @ c
    return o_latent.to(q_latent.dtype)
