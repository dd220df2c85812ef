"""The loss curve as a PNG: matplotlib where it is installed, else a plain raster written with zlib (the
curves and axes without labels; the numbers are in train_log.jsonl either way)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

_W, _H, _PAD = 800, 400, 30


def plot_losses(losses: list[float], evals: list[tuple[int, float]], path: Path,
                ylabel: str = "cross-entropy (nats/token)") -> None:
    """Training loss a step (blue) and validation loss at its evaluations (red), against the step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _raster(losses, evals, path)
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(range(len(losses)), losses, lw=0.8, label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", color="tab:red", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _raster(losses: list[float], evals: list[tuple[int, float]], path: Path) -> None:
    pixels = bytearray(b"\xff" * (_W * _H * 3))
    values = losses + [v for _, v in evals]
    lo, hi = min(values), max(values)
    span_x, span_y = max(1, len(losses) - 1), (hi - lo) or 1.0

    def point(step: float, value: float) -> tuple[int, int]:
        x = _PAD + round((_W - 2 * _PAD) * step / span_x)
        return x, _H - _PAD - round((_H - 2 * _PAD) * (value - lo) / span_y)

    def line(a: tuple[int, int], b: tuple[int, int], rgb: tuple[int, int, int]) -> None:
        n = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
        for i in range(n + 1):
            x, y = a[0] + (b[0] - a[0]) * i // n, a[1] + (b[1] - a[1]) * i // n
            if 0 <= x < _W and 0 <= y < _H:
                pixels[(y * _W + x) * 3 : (y * _W + x) * 3 + 3] = bytes(rgb)

    line((_PAD, _H - _PAD), (_W - _PAD, _H - _PAD), (0, 0, 0))
    line((_PAD, _PAD), (_PAD, _H - _PAD), (0, 0, 0))
    for series, rgb in ((list(enumerate(losses)), (31, 119, 180)), (evals, (214, 39, 40))):
        for a, b in zip(series, series[1:]):
            line(point(*a), point(*b), rgb)
    rows = b"".join(b"\x00" + bytes(pixels[y * _W * 3 : (y + 1) * _W * 3]) for y in range(_H))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", _W, _H, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body)
