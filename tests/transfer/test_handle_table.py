"""`HandleTable` (transfer/_ops.py), the open write batches of the Mooncake and NIXL backends: handles count from
1 and are never given out twice; a released or never-issued handle is a TransferError, not a KeyError."""

from __future__ import annotations

import pytest

from k3serve.transfer._ops import HandleTable
from k3serve.transfer.backend import TransferError


def test_handles_count_from_one_and_are_never_reused() -> None:
    table: HandleTable[str] = HandleTable()
    first, second = table.add("a"), table.add("b")
    assert (first, second) == (1, 2)
    assert table.pop(first) == "a" and table.pop(first) is None
    assert table.add("c") == 3
    assert table.handles() == [2, 3] and table.get(2) == "b"


@pytest.mark.parametrize("handle", [0, 1, 7])
def test_a_released_or_unknown_handle_is_a_transfer_error(handle: int) -> None:
    table: HandleTable[str] = HandleTable()
    table.pop(table.add("released"))
    with pytest.raises(TransferError, match=f"unknown or released handle {handle}"):
        table.get(handle)
