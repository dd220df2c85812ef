"""MLA attention (NoPE): MHA-form prefill, the paged latent KV cache, absorbed decode, and the LSE merge
used for split-KV and decode context parallelism (model/K3_MODEL.md §1c, §6).

Paged cache layout (vLLM reshape_and_cache convention), one MLA layer:

    kv_cache [num_blocks, block_size, L + R]      row = [ c (normalized latent, L) | k_pe (R) ]
    slot = block_id * block_size + offset          (slot_mapping; -1 = do not write)
    token p of sequence n -> block_tables[n, p // block_size], offset p % block_size

All LSEs are natural-log (convert base-2 LSEs, e.g. FlashInfer's default, before merging).
Decode and merge run the Triton kernels of `triton_decode.py` on CUDA (bf16/fp16, power-of-2 L, R and
block size), the cache write `triton_cache.py` (any dtype), else `naive.py`; `last_backend[name]` records which.
"""

from __future__ import annotations

from torch import Tensor

from .._backend import gpu_kernels, has_module
from . import dcp, naive, split_rule

last_backend: dict[str, str] = {}  # "mla_decode_paged" / "merge_attn_states" / "write_kv_cache" -> "triton" | "naive",
# "mla_prefill_attention" -> "sdpa" | "naive"

__all__ = ["mla_prefill_attention", "write_kv_cache", "gather_kv_cache", "mla_decode_paged", "merge_attn_states",
           "decode_workspace_bytes", "mla_verify_paged", "mla_decode_dcp", "dcp"]


def decode_workspace_bytes(num_heads: int, latent_dim: int, num_sm: int) -> int:
    """Most bytes `mla_decode_paged` allocates beside its output on a GPU of `num_sm` SMs, whatever the batch and
    the context: its split-K partials, fp32 outputs [N, H, splits, L] and LSEs [N, H, splits] (L = `latent_dim`).
    The splits fill `default_waves` waves of programs (`split_rule.split_plan`: (sequence, head group) pairs x
    splits <= waves x num_sm, a head group `block_h` heads; one split writes the output directly), counted at the
    stages of a GPU with the least shared memory, which runs the most waves."""
    waves = split_rule.default_waves(split_rule.num_stages(num_heads, shared_per_block=0))
    rows = waves * num_sm * split_rule.block_h(num_heads)  # (sequence, head, split) triples at most
    return rows * (latent_dim + 1) * 4


def _check_cu_seqlens(name: str, cu_seqlens: Tensor, total: int) -> list[int]:
    """The bounds as a host list (a tensor on a GPU is read back once: pass host tensors to avoid the sync)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"{name} must be an integer tensor [N+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"{name} must rise from 0 to {total}, got {bounds}")
    return bounds


def _check_paged(kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor) -> int:
    """Returns max(seq_lens) (or, for seq_lens on a GPU, the table's capacity, to avoid a sync).

    The values (lengths in range, used table entries naming real blocks) are checked where they live on
    the CPU; tensors already on a GPU are trusted (the block pool built them), so decode needs no sync."""
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, L+R], got {tuple(kv_cache.shape)}")
    if block_tables.dim() != 2 or block_tables.is_floating_point():
        raise ValueError(
            f"block_tables must be integer [N, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_tables.shape[0] or seq_lens.is_floating_point():
        raise ValueError(
            f"seq_lens must be integer [N={block_tables.shape[0]}], got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    num_blocks, block_size, _ = kv_cache.shape
    capacity = block_tables.shape[1] * block_size
    if seq_lens.is_cuda:
        return capacity
    lens = seq_lens.tolist()
    if any(n < 0 or n > capacity for n in lens):
        raise ValueError(f"seq_lens {lens} must lie in [0, max_blocks*block_size={capacity}]")
    if not block_tables.is_cuda:
        for n, length in enumerate(lens):
            used = block_tables[n, : -(-length // block_size)]
            if ((used < 0) | (used >= num_blocks)).any():
                raise ValueError(f"block_tables[{n}] uses a block outside [0, {num_blocks}): {used.tolist()}")
    return max(lens, default=0)


def mla_prefill_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float
) -> Tensor:
    """Causal varlen MHA: q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] -> [Tq, H, Dv] in q.dtype.

    Sequence n's q_len queries are the LAST q_len of its k_len keys (chunked prefill over a cached
    prefix): query i sees keys 0 .. k_len - q_len + i. On CUDA it runs torch's fused SDPA a sequence at a
    time (`sdpa_prefill.py`); cu_seqlens on the host cost it no sync."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[1:] != q.shape[1:] or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"expected q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    bounds_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    bounds_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    q_lens = [b - a for a, b in zip(bounds_q[:-1], bounds_q[1:])]
    k_lens = [b - a for a, b in zip(bounds_k[:-1], bounds_k[1:])]
    if len(q_lens) != len(k_lens) or any(q_len > k_len for q_len, k_len in zip(q_lens, k_lens)):
        raise ValueError(f"each sequence needs q_len <= k_len, got cu_seqlens_q {bounds_q}, cu_seqlens_k {bounds_k}")
    if v.shape[2] <= q.shape[2] and gpu_kernels(q, k, v):
        from . import sdpa_prefill

        last_backend["mla_prefill_attention"] = "sdpa"
        return sdpa_prefill.mla_prefill_attention(q, k, v, bounds_q, bounds_k, scale)
    last_backend["mla_prefill_attention"] = "naive"
    return naive.mla_prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)


def write_kv_cache(kv_cache: Tensor, slot_mapping: Tensor, latent: Tensor) -> None:
    """kv_cache [num_blocks, block_size, L+R] <- latent [T, L+R] at slot_mapping int64 [T] (-1 = skip), in place."""
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, L+R], got {tuple(kv_cache.shape)}")
    if latent.dim() != 2 or latent.shape[1] != kv_cache.shape[2]:
        raise ValueError(f"latent must be [T, L+R={kv_cache.shape[2]}], got {tuple(latent.shape)}")
    if slot_mapping.shape != (latent.shape[0],) or slot_mapping.is_floating_point():
        raise ValueError(
            f"slot_mapping must be integer [T={latent.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if gpu_kernels(kv_cache, slot_mapping, latent) and has_module("triton") and kv_cache.stride(-1) == 1:
        # Values on a GPU come from the engine's batch and are trusted: checking them costs a host sync.
        from . import triton_cache

        last_backend["write_kv_cache"] = "triton"
        triton_cache.write_kv_cache(kv_cache, slot_mapping, latent.to(kv_cache.dtype))
        return
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    if ((slot_mapping < -1) | (slot_mapping >= num_slots)).any():
        raise ValueError(f"slot_mapping must lie in [-1, {num_slots}), got {slot_mapping.tolist()}")
    last_backend["write_kv_cache"] = "naive"
    naive.write_kv_cache(kv_cache, slot_mapping, latent)


def gather_kv_cache(kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor) -> tuple[Tensor, Tensor]:
    """Cached tokens of each sequence, packed: (packed [sum(seq_lens), L+R], cu_seqlens int64 [N+1] where
    seq_lens lives).

    block_tables int32 [N, max_blocks]; entries past a sequence's used blocks may be -1. seq_lens on the host
    with a cache on a GPU (the prefill path) costs no device read-back."""
    _check_paged(kv_cache, block_tables, seq_lens)
    return naive.gather_kv_cache(kv_cache, block_tables, seq_lens)


def mla_decode_paged(
    q_latent: Tensor,
    q_pe: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[Tensor, Tensor]:
    """Absorbed MLA decode, one query token per sequence.

    q_latent [N, H, L] (= q_nope @ W_UK), q_pe [N, H, R]: any float dtype and head/sequence strides (the GPU
    kernel rounds both to the cache dtype as it loads them; nothing is copied); block_tables and seq_lens
    int32 or int64. scores = (q_latent·c + q_pe·k_pe) * scale over the seq_lens[n] cached tokens. Returns
    (o_latent [N, H, L] in q_latent.dtype, lse [N, H] fp32, natural log); apply W_UV to o_latent afterwards.
    A sequence with 0 tokens (an empty DCP shard) gives 0, -inf."""
    max_seq_len = _check_paged(kv_cache, block_tables, seq_lens)
    if q_latent.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_latent.shape[:2]:
        raise ValueError(
            f"q_latent must be [N, H, L] and q_pe [N, H, R], got {tuple(q_latent.shape)} and {tuple(q_pe.shape)}"
        )
    if q_latent.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q_latent has {q_latent.shape[0]} sequences but block_tables has {block_tables.shape[0]}")
    if q_latent.shape[2] != kv_lora_rank or kv_lora_rank + q_pe.shape[2] != kv_cache.shape[2]:
        raise ValueError(
            f"q_latent {tuple(q_latent.shape)} and q_pe {tuple(q_pe.shape)} do not split kv_cache rows of "
            f"{kv_cache.shape[2]} as L={kv_lora_rank} + R"
        )
    if gpu_kernels(q_latent, q_pe, kv_cache) and has_module("triton"):
        from . import triton_decode

        if triton_decode.supports(q_latent, q_pe, kv_cache):
            last_backend["mla_decode_paged"] = "triton"
            return triton_decode.mla_decode_paged(q_latent, q_pe, kv_cache, block_tables, seq_lens, scale,
                                                  max_seq_len)
    last_backend["mla_decode_paged"] = "naive"
    return naive.mla_decode_paged(q_latent, q_pe, kv_cache, block_tables, seq_lens, scale, kv_lora_rank)


def merge_attn_states(outputs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Merge P partial attentions over disjoint key sets: outputs [P, N, H, D], lses [P, N, H] (natural log).

    Returns (o [N, H, D] in outputs.dtype, lse [N, H] fp32) with lse = logsumexp_p lse_p and
    o = Σ_p exp(lse_p - lse) o_p. Parts with lse -inf add 0; if all are -inf, o = 0 and lse = -inf."""
    if outputs.dim() != 4 or lses.shape != outputs.shape[:3]:
        raise ValueError(
            f"outputs must be [P, N, H, D] and lses [P, N, H], got {tuple(outputs.shape)} and {tuple(lses.shape)}"
        )
    if gpu_kernels(outputs, lses) and has_module("triton") and outputs.numel() > 0:
        from . import triton_decode

        last_backend["merge_attn_states"] = "triton"
        return triton_decode.merge_attn_states(outputs.contiguous(), lses)
    last_backend["merge_attn_states"] = "naive"
    return naive.merge_attn_states(outputs, lses)


def mla_decode_dcp(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                   scale: float, kv_lora_rank: int, dcp_size: int) -> tuple[Tensor, Tensor]:
    """`mla_decode_paged` over a cache of virtual blocks [num_blocks, W * page, L+R] as W = `dcp_size` DCP ranks
    run it, in one process: each rank's decode over its pages (`dcp.shard_cache`, `dcp.local_seq_lens`), then
    `merge_attn_states` of the W parts. Equals the unsplit decode to rounding; for tests and benchmarks (an
    engine runs one rank's part, `model/layers/mla_dcp.py`)."""
    if dcp_size < 1 or kv_cache.dim() != 3 or kv_cache.shape[1] % dcp_size:
        raise ValueError(f"dcp_size={dcp_size} must be >= 1 and divide the block of kv_cache {tuple(kv_cache.shape)}")
    _check_paged(kv_cache, block_tables, seq_lens)
    return dcp.split_decode(mla_decode_paged, merge_attn_states, q_latent, q_pe, kv_cache, block_tables, seq_lens,
                            scale, kv_lora_rank, dcp_size)


def mla_verify_paged(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: list[int],
                     cu_q: list[int], scale: float, kv_lora_rank: int) -> Tensor:
    """Absorbed MLA over the verify rows of a speculative step: sequence n's q_len = cu_q[n+1] - cu_q[n] rows
    are its last q_len tokens, row i attending causally to its first seq_lens[n] - (q_len - 1 - i) cached keys
    (all of them written this step). Each sequence's latent KV is read once, not once a row. Returns o_latent
    [T, H, L] in q_latent.dtype (apply W_UV afterwards); each row equals `mla_decode_paged` of its length."""
    if q_latent.dim() != 3 or q_pe.shape[:2] != q_latent.shape[:2] or cu_q[-1] != q_latent.shape[0]:
        raise ValueError(f"mla_verify_paged: q_latent [T, H, L], q_pe [T, H, R], cu_q ending at T; got "
                         f"{tuple(q_latent.shape)}, {tuple(q_pe.shape)}, {cu_q}")
    if len(seq_lens) != len(cu_q) - 1 or block_tables.shape[0] != len(seq_lens) or any(
            n < b - a for n, a, b in zip(seq_lens, cu_q[:-1], cu_q[1:])):
        raise ValueError(f"mla_verify_paged: one table and seq_len >= q_len a sequence; got seq_lens {seq_lens}, "
                         f"cu_q {cu_q}, {block_tables.shape[0]} tables")
    last_backend["mla_verify_paged"] = "naive"
    return naive.mla_verify_paged(q_latent, q_pe, kv_cache, block_tables, seq_lens, cu_q, scale, kv_lora_rank)
