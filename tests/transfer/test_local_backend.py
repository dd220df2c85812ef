"""LocalBackend spec: one-sided writes between registered regions of two in-process agents,
checked in full when posted, landing only when a poll completes them, with notifications and
injected faults."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from k3serve.transfer.backend import TransferError, TransferStatus, WriteOp
from k3serve.transfer.local import Fault, LocalBackend


@pytest.fixture
def agents() -> Iterator[tuple[LocalBackend, LocalBackend, torch.Tensor, torch.Tensor]]:
    """A sender with region `src` (0..63) and a receiver with region `dst` (zeros), connected."""
    sender, receiver = LocalBackend(), LocalBackend(polls_to_complete=1)
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    sender.register("src", src)
    receiver.register("dst", dst)
    sender.connect(receiver.agent_info())
    yield sender, receiver, src, dst
    sender.close()
    receiver.close()


def test_write_lands_the_bytes_and_notifies_the_peer(agents) -> None:
    sender, receiver, src, dst = agents
    ops = [WriteOp(src.data_ptr() + 8, dst.data_ptr() + 40, 8), WriteOp(src.data_ptr(), dst.data_ptr(), 4)]
    handle = sender.write(receiver.endpoint, ops, notify=b"req-1 ready")
    assert sender.poll(handle) is TransferStatus.DONE
    assert dst[40:48].tolist() == list(range(8, 16))
    assert dst[0:4].tolist() == [0, 1, 2, 3]
    assert dst[4:40].eq(0).all() and dst[48:].eq(0).all()
    assert receiver.get_notifications() == [(sender.endpoint, b"req-1 ready")]
    assert receiver.get_notifications() == []  # delivered once
    sender.release(handle)
    with pytest.raises(TransferError, match="unknown transfer handle"):
        sender.poll(handle)


def test_nothing_lands_before_the_batch_completes() -> None:
    sender, receiver = LocalBackend(polls_to_complete=3), LocalBackend()
    try:
        src, dst = torch.full((16,), 7, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
        sender.register("src", src)
        receiver.register("dst", dst)
        sender.connect(receiver.agent_info())
        handle = sender.write(receiver.endpoint, [WriteOp(src.data_ptr(), dst.data_ptr(), 16)], notify=b"n")
        assert [sender.poll(handle), sender.poll(handle)] == [TransferStatus.PENDING] * 2
        assert dst.eq(0).all() and receiver.get_notifications() == []
        assert sender.poll(handle) is TransferStatus.DONE
        assert dst.eq(7).all()
        assert sender.poll(handle) is TransferStatus.DONE  # stays done
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(
    ("src_at", "dst_at", "length", "what"),
    [
        (0, 60, 8, "destination"),  # runs past the end of dst
        (60, 0, 8, "source"),  # runs past the end of src
        (-1, 0, 4, "source"),  # starts before src
        (0, 64, 1, "destination"),  # starts right after dst
    ],
)
def test_out_of_bounds_ops_are_refused_when_posted(agents, src_at: int, dst_at: int, length: int, what: str) -> None:
    sender, receiver, src, dst = agents
    good = WriteOp(src.data_ptr(), dst.data_ptr(), 4)
    bad = WriteOp(src.data_ptr() + src_at, dst.data_ptr() + dst_at, length)
    with pytest.raises(TransferError, match=f"{what} of .* outside every registered region"):
        sender.write(receiver.endpoint, [good, bad])
    assert dst.eq(0).all()  # the good op did not land either


def test_a_destination_in_another_agents_region_is_refused(agents) -> None:
    sender, receiver, src, _ = agents
    third = LocalBackend()
    try:
        elsewhere = torch.zeros(64, dtype=torch.uint8)
        third.register("dst", elsewhere)
        with pytest.raises(TransferError, match="destination"):
            sender.write(receiver.endpoint, [WriteOp(src.data_ptr(), elsewhere.data_ptr(), 4)])
        with pytest.raises(TransferError, match="not connected"):
            sender.write(third.endpoint, [WriteOp(src.data_ptr(), elsewhere.data_ptr(), 4)])
    finally:
        third.close()


def test_injected_fault_fails_the_batch_after_a_partial_write(agents) -> None:
    sender, receiver, src, dst = agents
    sender.fault = lambda peer, ops: Fault("nic reset", ops_landed=1)
    ops = [WriteOp(src.data_ptr(), dst.data_ptr(), 4), WriteOp(src.data_ptr() + 4, dst.data_ptr() + 4, 4)]
    handle = sender.write(receiver.endpoint, ops, notify=b"never")
    assert sender.poll(handle) is TransferStatus.FAILED
    assert sender.error(handle) == "nic reset"
    assert dst[:4].tolist() == [0, 1, 2, 3] and dst[4:8].eq(0).all()  # partial, and reported as FAILED
    assert receiver.get_notifications() == []


def test_a_peer_that_goes_away_fails_pending_writes() -> None:
    sender, receiver = LocalBackend(polls_to_complete=2), LocalBackend()
    try:
        src, dst = torch.ones(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
        sender.register("src", src)
        receiver.register("dst", dst)
        sender.connect(receiver.agent_info())
        handle = sender.write(receiver.endpoint, [WriteOp(src.data_ptr(), dst.data_ptr(), 8)])
        assert sender.poll(handle) is TransferStatus.PENDING
        receiver.close()
        assert sender.poll(handle) is TransferStatus.FAILED
        assert "went away" in sender.error(handle)
        assert dst.eq(0).all()
        with pytest.raises(TransferError, match="gone"):
            sender.write(receiver.endpoint, [WriteOp(src.data_ptr(), dst.data_ptr(), 8)])
    finally:
        sender.close()
        receiver.close()  # second close is a no-op


def test_connect_checks_the_peer_is_alive_and_as_advertised() -> None:
    sender, receiver = LocalBackend(), LocalBackend()
    try:
        dst = torch.zeros(8)
        info = receiver.agent_info()  # advertised before "dst" was registered: no regions yet
        receiver.register("dst", dst)
        sender.connect(info)  # fewer regions than now: fine
        stale = receiver.agent_info()
        receiver.close()
        with pytest.raises(TransferError, match="no local agent"):
            sender.connect(stale)
    finally:
        sender.close()


def test_registration_rules() -> None:
    agent = LocalBackend(endpoint="prefill-0")
    try:
        with pytest.raises(TransferError, match="already exists"):
            LocalBackend(endpoint="prefill-0")
        agent.register("a", torch.zeros(4, 4))
        with pytest.raises(TransferError, match="already registered"):
            agent.register("a", torch.zeros(4))
        with pytest.raises(TransferError, match="contiguous"):
            agent.register("b", torch.zeros(4, 4).t())
        region = agent.agent_info().regions[0]
        assert (region.name, region.length, region.device) == ("a", 64, "cpu")
    finally:
        agent.close()
    with pytest.raises(TransferError, match="closed"):
        agent.register("c", torch.zeros(1))
