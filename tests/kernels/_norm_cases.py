"""The norm cases that the Triton kernel must match the torch reference on, shared by the GPU test and the
CPU test under the Triton interpreter: K3's shapes (hidden 7168, MLA latent 512 read out of a 576-wide row,
and normalized in place there, KDA head 128 with its gate), bf16 and fp32 inputs, and no weight."""

from __future__ import annotations

from typing import Callable

import torch

from k3serve.kernels.norm import naive

from _close import assert_close

EPS = 1e-6
Norms = tuple[Callable, Callable, Callable]  # rms_norm, gated_rms_norm, l2_normalize


def check_norms_match_reference(norms: Norms, device: str, rows: int) -> None:
    """Every form of every case within one output rounding of `naive.py` (the fp32 sum order differs)."""
    rms_norm, gated_rms_norm, l2_normalize = norms
    for dtype, tol in ((torch.bfloat16, 8e-3), (torch.float32, 2e-5)):
        hidden = (torch.randn(rows, 7168, device=device) * 3).to(dtype)
        w_hidden = 1 + 0.1 * torch.randn(7168, device=device).to(dtype)
        assert_close(f"rms_norm {dtype} hidden", naive.rms_norm(hidden, w_hidden, EPS), rms_norm(hidden, w_hidden, EPS), tol, tol)
        assert_close(f"rms_norm {dtype} no weight", naive.rms_norm(hidden, None, EPS), rms_norm(hidden, None, EPS), tol, tol)

        fp32_hidden = hidden.float() * 1.3  # as the latent MoE's summed experts, normalized into bf16
        assert_close(f"rms_norm {dtype} fp32 in, bf16 out", naive.rms_norm(fp32_hidden, w_hidden, EPS).bfloat16(),
                     rms_norm(fp32_hidden, w_hidden, EPS, torch.bfloat16), 8e-3, 8e-3)

        kv = torch.randn(rows, 576, device=device).to(dtype)[:, :512]  # strided rows, as MLA's kv_a_layernorm
        w_latent = torch.randn(512, device=device).to(dtype)
        out = rms_norm(kv, w_latent, EPS)
        assert out.is_contiguous()
        assert_close(f"rms_norm {dtype} latent", naive.rms_norm(kv, w_latent, EPS), out, tol, tol)
        row = torch.randn(rows, 576, device=device).to(dtype)  # MLA's row [c | k_pe]: c normalized in place
        expected = torch.cat([naive.rms_norm(row[:, :512], w_latent, EPS), row[:, 512:]], dim=-1)
        assert rms_norm(row[:, :512], w_latent, EPS, out=row[:, :512]).data_ptr() == row.data_ptr()
        assert_close(f"rms_norm {dtype} in place", expected, row, tol, tol)

        o = torch.randn(rows, 12, 128, device=device).to(dtype)
        gate = (torch.randn(rows, 12, 128, device=device) * 4).to(dtype)
        w_head = torch.randn(128, device=device)  # fp32, as KDA's o_norm
        assert_close(f"gated_rms_norm {dtype}", naive.gated_rms_norm(o, gate, w_head, EPS),
                     gated_rms_norm(o, gate, w_head, EPS), tol, tol)
        assert_close(f"l2_normalize {dtype}", naive.l2_normalize(o, EPS), l2_normalize(o, EPS), tol, tol)
        fused = (torch.randn(rows, 3 * 12 * 128, device=device) * 4).to(dtype)  # a fused projection's output:
        gate_view = fused[:, 12 * 128 : 24 * 128].reshape(rows, 12, 128)  # the gate is a [T, H, D] column slice
        assert_close(f"gated_rms_norm {dtype} gate slice", naive.gated_rms_norm(o, gate_view, w_head, EPS),
                     gated_rms_norm(o, gate_view, w_head, EPS), tol, tol)
        assert rms_norm(hidden[:0], w_hidden, EPS).shape == (0, 7168)
