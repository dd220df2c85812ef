"""MooncakeBackend (TCP, P2PHANDSHAKE) between two real processes on loopback.

Needs `mooncake-transfer-engine-non-cuda` and libibverbs1 (scripts/setup.sh installs both);
skipped only where the package cannot be imported."""

from __future__ import annotations

import sys

import pytest
import torch

from k3serve.transfer.backend import AgentInfo, RegionDesc, TransferError, WriteOp

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda not installed")

import _xfer_workers as w  # noqa: E402  (tests/transfer is on sys.path: rootdir-relative imports)


def test_two_process_write_is_byte_exact() -> None:
    """64 MiB + odd-sized regions; aligned, unaligned, 7-byte, 1-byte and coalescable ops in two
    concurrent batches; the receiver checks every byte, written or not."""
    w.roundtrip("mooncake")


def test_write_to_exited_peer_fails_fast() -> None:
    status, err, secs = w.peer_crash("mooncake", {"timeout_s": 10}, bound_s=30)
    assert secs < 30


def test_unreachable_peer_raises() -> None:
    """A peer whose RPC port has nothing listening: submit fails at once (Mooncake 0.3.13 returns
    batch id 0 there, which must never be polled: it segfaults)."""
    from k3serve.transfer.mooncake import MooncakeBackend

    b = MooncakeBackend()
    try:
        src = torch.zeros(4096, dtype=torch.uint8)
        b.register("src", src)
        peer = b.connect(AgentInfo("mooncake", "127.0.0.1:1", b"", (RegionDesc("dst", 1 << 40, 4096, "cpu"),)))
        with pytest.raises(TransferError, match="not reachable"):
            b.write(peer, [WriteOp(src.data_ptr(), 1 << 40, 7)])
    finally:
        b.close()
        b.close()  # idempotent


def test_ops_outside_regions_rejected_and_notify_ignored() -> None:
    from k3serve.transfer.mooncake import MooncakeBackend

    b = MooncakeBackend()
    try:
        assert b.supports_notify is False
        src = torch.zeros(100, dtype=torch.uint8)
        r = b.register("src", src)
        info = b.agent_info()
        assert info.backend == "mooncake" and info.endpoint.startswith("127.0.0.1:") and info.regions == (r,)
        with pytest.raises(TransferError, match="already registered"):
            b.register("src", src)
        peer = b.connect(AgentInfo("mooncake", "127.0.0.1:1", b"", (RegionDesc("dst", 1 << 40, 64, "cpu"),)))
        with pytest.raises(TransferError, match="source range"):
            b.write(peer, [WriteOp(src.data_ptr() + 90, 1 << 40, 11)])
        with pytest.raises(TransferError, match="target range"):
            b.write(peer, [WriteOp(src.data_ptr(), (1 << 40) + 60, 5)])
        with pytest.raises(TransferError, match="unknown peer"):
            b.write("nobody:1", [WriteOp(src.data_ptr(), 1 << 40, 1)])
        with pytest.raises(TransferError, match="unknown or released handle"):
            b.poll(12345)
    finally:
        b.close()
    with pytest.raises(TransferError, match="closed"):
        b.agent_info()


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from k3serve.transfer import mooncake

    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import -> ImportError
    with pytest.raises(TransferError) as e:
        mooncake.MooncakeBackend()
    msg = str(e.value)
    assert "mooncake-transfer-engine-non-cuda" in msg and "mooncake-transfer-engine-cuda13" in msg
    assert "libibverbs1" in msg

