"""The mid-chunk checkpoint case that the Triton checkpoint kernel (kernels/kda/triton_checkpoint.py) must match
the torch reference on, shared by the GPU test and the CPU test under the Triton interpreter: fla's intermediates
in their GPU dtypes (bf16 chunk states, keys and v_new, fp32 log2 gate cumsum), three packed sequences
(chunk size 64 and 32), checkpoints mid-chunk in a sequence's second chunk, on a chunk edge (m = chunk size),
in a partly filled last chunk, and none; K3's head size 128, 2 heads.

The reference is `naive._advance` of the chunk's start state by its first m tokens, in fp64 on the CPU, and the
bound is fp32's: the kernel's in-chunk sum runs on tensor cores as 3xTF32, whose error is fp32's; plain TF32
(one pass, the decayed keys rounded to a 10-bit mantissa) is off by ~6e-5 here (torch emulation) and fails."""

from __future__ import annotations

import math

import torch

from k3serve.kernels.kda import naive
from k3serve.kernels.kda.chunk_plan import plan_chunks
from k3serve.kernels.kda.triton_checkpoint import checkpoint_states

from _close import assert_rel_rms

H, K, V = 2, 128, 128
TOL = 1e-5


def check_checkpoints_match_reference(device: str) -> None:
    """The kernel writes every output row: a row without a checkpoint comes out zero over NaN garbage."""
    seq_lens, offsets = [150, 64, 37, 90], [100, 64, -1, 90]
    for chunk in (64, 32):
        num_chunks = [-(-n // chunk) for n in seq_lens]
        T = sum(seq_lens)
        h = torch.randn(sum(num_chunks), H, K, V, device=device).bfloat16()  # start state of every chunk, in order
        k = torch.nn.functional.normalize(torch.randn(T, H, K, device=device), dim=-1).bfloat16()
        v_new = torch.randn(T, H, V, device=device).bfloat16()
        g = -5 * torch.rand(T, H, K, device=device)  # the K3 bounded gate, natural log
        gc = torch.empty_like(g)  # its cumsum inside each chunk of each sequence, in log2 units
        token0, chunk0, firsts = 0, 0, []
        for n, length in enumerate(seq_lens):
            for start in range(token0, token0 + length, chunk):
                end = min(start + chunk, token0 + length)
                gc[start:end] = g[start:end].cumsum(0) / math.log(2)
            firsts.append((token0, chunk0))
            token0, chunk0 = token0 + length, chunk0 + num_chunks[n]

        plan = plan_chunks(seq_lens, True, offsets, chunk, torch.device(device))
        out = torch.full((len(seq_lens), H, K, V), float("nan"), device=device)  # as uninitialized as torch.empty
        checkpoint_states(h, k, gc, v_new, plan.checkpoints, out, chunk)

        out, h, k, gc, v_new = (t.cpu().double() for t in (out, h, k, gc, v_new))
        for n, ((token0, chunk0), p) in enumerate(zip(firsts, offsets)):
            if p < 0:
                assert (out[n] == 0).all(), f"chunk {chunk}: sequence {n} has no checkpoint"
                continue
            j = (p - 1) // chunk  # the chunk holding token p - 1, of which m tokens come before the checkpoint
            m, first = p - j * chunk, token0 + j * chunk
            G, k_j, v_j = (t[first : first + m].transpose(0, 1) for t in (gc * math.log(2), k, v_new))
            ref = naive._advance(h[chunk0 + j], G, k_j, v_j, m)
            assert_rel_rms(f"chunk {chunk}: checkpoint after {p} tokens of sequence {n}", ref, out[n], TOL)
