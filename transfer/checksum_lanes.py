"""The lane arithmetic both checksum paths share (`checksum.py` on CPU, `checksum_triton.py` on CUDA): the
primes, the shift of a word, the table of powers of R, and `Piece`, the words a lane sum covers. The scheme is
described in `checksum.py`."""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

_P1 = 2**31 - 1  # prime: position weights 1..p1-1 are distinct and nonzero
_P2 = 2**31 - 19  # prime
_R = 0x5DEECE6E  # a primitive root mod p2: lane-2 weights R^p repeat only after p2 - 1 words
_SHIFT = 32769  # int16 word w -> w + 32769 in 1..65536
_DIGIT = 11  # R^q as a product over the three 11-bit digits of q (< 2^33: past any view); checksum._ROW <= 2^_DIGIT


class Piece(NamedTuple):  # a NamedTuple: a K3 rank's request makes 162 of them per checksum pass
    """`count` 16-bit words at word position `offset` of a region's view, read from the contiguous
    tensor `source` in runs of `run` words: run k starts at word `first + runs[k] * run` of `source`
    (the last run is cut at `count`). One run (`runs == (0,)`) for a slot's KDA state; a
    request's MLA blocks for an MLA layer, so neither path gathers them into a new tensor first."""

    region: str
    source: torch.Tensor
    first: int
    count: int
    offset: int
    run: int
    runs: tuple[int, ...] = (0,)


_POWERS: dict[torch.device, torch.Tensor] = {}
_POWERS_LOCK = threading.Lock()


def _powers(device: torch.device) -> torch.Tensor:
    """int64 [3, 2^_DIGIT] on `device`: R^(i * 2^(level * _DIGIT)) mod p2 at [level, i], built once per
    device. The one table of powers of R: both paths read R^q from it (`_power_at`, and the same in the kernel)."""
    with _POWERS_LOCK:
        powers = _POWERS.get(device)
        if powers is None:
            levels = []
            for level in range(3):
                step, power, row = pow(_R, 1 << (level * _DIGIT), _P2), 1, []
                for _ in range(1 << _DIGIT):
                    row.append(power)
                    power = power * step % _P2
                levels.append(row)
            powers = _POWERS[device] = torch.tensor(levels, dtype=torch.int64, device=device)
        return powers


def _power_at(q: torch.Tensor, powers: torch.Tensor) -> torch.Tensor:
    """R^q mod p2 for int64 positions 0 <= q < 2^(3 * _DIGIT): one power of `_powers` a digit of q (each
    product of two residues < 2^62)."""
    mask = (1 << _DIGIT) - 1
    power = powers[0][q & mask] * powers[1][(q >> _DIGIT) & mask] % _P2
    return power * powers[2][q >> (2 * _DIGIT)] % _P2
