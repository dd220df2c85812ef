"""Named tolerance check shared by the kernel tests (fla's `assert_close` habit): fails on NaN and
reports the max abs diff and relative RMS error so a failure says how far off, not just that it is."""

from __future__ import annotations

import torch
from torch import Tensor


def assert_close(name: str, ref: Tensor, out: Tensor, atol: float, rtol: float) -> None:
    """|out - ref| <= atol + rtol·|ref| elementwise (atol = rtol = 0 means bit-exact), same shape, no NaN."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    ref64, out64 = ref.double(), out.double()
    assert not torch.isnan(out64).any() or torch.equal(torch.isnan(out64), torch.isnan(ref64)), f"{name}: NaN in output"
    diff = (out64 - ref64).abs().nan_to_num(0.0)
    bad = diff > atol + rtol * ref64.abs().nan_to_num(0.0)
    rms_err = diff.pow(2).mean().sqrt() / ref64.nan_to_num(0.0).pow(2).mean().sqrt().clamp_min(1e-30)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())}/{bad.numel()} elements off; max abs diff {diff.max().item():.3e}, "
        f"relative RMS error {rms_err.item():.3e} (atol {atol}, rtol {rtol})"
    )


def assert_rel_rms(name: str, ref: Tensor, out: Tensor, tol: float) -> float:
    """‖out - ref‖ / ‖ref‖ <= tol over finite references, no NaN or inf in out where ref is finite
    (the check for bf16 GPU kernels, whose elementwise error has outliers). Returns the error."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    ref64, out64 = ref.double(), out.double()
    finite = torch.isfinite(ref64)
    assert torch.isfinite(out64[finite]).all(), f"{name}: NaN/inf in output where the reference is finite"
    err = ((out64 - ref64)[finite].norm() / ref64[finite].norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"
    return err
