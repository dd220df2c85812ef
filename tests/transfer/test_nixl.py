"""NixlBackend (UCX) between two real processes on loopback, with notifications.

Needs `nixl-cu13` (installed with --no-deps by scripts/setup.sh); skipped only where no NIXL
package can be imported."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from k3serve.transfer.backend import AgentInfo, RegionDesc, TransferError, TransferStatus, WriteOp

from k3serve.transfer._ops import RegionIndex  # noqa: E402
from k3serve.transfer.nixl import import_nixl_api  # noqa: E402

try:
    import_nixl_api()  # nixl_cu13._api, then nixl_cu12._api, then nixl._api
except TransferError:
    pytest.skip("no NIXL package (nixl-cu13) installed", allow_module_level=True)

import _xfer_workers as w  # noqa: E402


def test_two_process_write_is_byte_exact_with_notification() -> None:
    """64 MiB + odd-sized regions; aligned, unaligned, 7-byte and 1-byte ops in two concurrent
    batches; the last batch carries a notification that must reach the receiver."""
    w.roundtrip("nixl", notify=w.NOTIFY)


def test_idle_agent_does_not_burn_a_core() -> None:
    """The progress thread sleeps between rounds (`progress_delay_us`); the wrapper's own setting
    busy-polls a core. The thread stays on: the roundtrip above is only notified through it."""
    import time

    from k3serve.transfer.nixl import NixlBackend

    b = NixlBackend(agent_name="k3-test-idle")
    try:
        b.register("buf", torch.zeros(1 << 20, dtype=torch.uint8))
        b.agent_info()
        time.sleep(0.2)  # the progress thread is up
        cpu = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - cpu < 0.3, "an idle NIXL agent kept a core busy"
    finally:
        b.close()
    with pytest.raises(ValueError, match="progress_delay_us"):
        NixlBackend(progress_delay_us=-1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_write_lands_and_notifies_with_the_sleeping_progress_thread(device: str) -> None:
    """Two agents in this process, the target's memory on `device` (VRAM on a GPU host): a
    write lands byte-exact and its notification arrives, with the default progress delay."""
    import time

    from k3serve.transfer.nixl import NixlBackend

    sender, receiver = NixlBackend(agent_name="k3-test-tx"), NixlBackend(agent_name="k3-test-rx")
    try:
        src = torch.arange(4096, dtype=torch.int32)
        dst = torch.zeros(4096, dtype=torch.int32, device=device)
        sender.register("src", src)
        receiver.register("dst", dst)
        peer = sender.connect(receiver.agent_info())
        handle = sender.write(peer, [WriteOp(src.data_ptr(), dst.data_ptr(), src.numel() * 4)], notify=b"landed")
        deadline, notes = time.monotonic() + 10, []
        while (status := sender.poll(handle)) is TransferStatus.PENDING or not notes:
            notes += receiver.get_notifications()
            assert time.monotonic() < deadline, f"write {status}, notifications {notes}"
            time.sleep(0.001)
        sender.release(handle)
        assert status is TransferStatus.DONE and notes == [("k3-test-tx", b"landed")]
        assert torch.equal(dst.cpu(), src)
    finally:
        sender.close()
        receiver.close()


def test_write_to_exited_peer_fails_fast() -> None:
    status, err, secs = w.peer_crash("nixl", {"timeout_s": 10}, bound_s=30)
    assert secs < 30


def test_local_validation_and_notifications_api() -> None:
    from k3serve.transfer.nixl import NixlBackend

    b = NixlBackend(agent_name="k3-test-validation")
    try:
        assert b.supports_notify is True
        src = torch.zeros(100, dtype=torch.uint8)
        r = b.register("src", src)
        info = b.agent_info()
        assert info.backend == "nixl" and info.endpoint == "k3-test-validation" and info.regions == (r,)
        assert isinstance(info.metadata, bytes) and len(info.metadata) > 0
        assert b.get_notifications() == []
        peer = AgentInfo("nixl", "k3-fake-peer", b"", (RegionDesc("dst", 1 << 40, 64, "cpu"),))
        b._peers[peer.endpoint] = RegionIndex(peer.regions)  # known regions, no live agent behind them
        with pytest.raises(TransferError, match="source range"):
            b.write(peer.endpoint, [WriteOp(src.data_ptr() + 90, 1 << 40, 11)])
        with pytest.raises(TransferError, match="target range"):
            b.write(peer.endpoint, [WriteOp(src.data_ptr(), (1 << 40) + 60, 5)])
        with pytest.raises(TransferError, match="backend 'mooncake'"):
            b.connect(AgentInfo("mooncake", "127.0.0.1:1", b"", ()))
    finally:
        b.close()
        b.close()


def test_ucx_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from k3serve.transfer.nixl import _ucx_env_defaults

    for tls, nodelay, ehm in [
        (None, "y", None), ("all", "y", None), ("tcp", "y", None), ("cma,tcp", "y", None),
        ("^cuda_ipc", "y", None), ("^tcp", None, None), ("shm,self", None, "none"), ("rc,self", None, None),
    ]:
        monkeypatch.delenv("UCX_TCP_NODELAY", raising=False)
        if tls is None:
            monkeypatch.delenv("UCX_TLS", raising=False)
        else:
            monkeypatch.setenv("UCX_TLS", tls)
        params: dict[str, str] = {}
        _ucx_env_defaults(params)
        assert os.environ.get("UCX_TCP_NODELAY") == nodelay, tls
        assert params.get("ucx_error_handling_mode") == ehm, tls


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from k3serve.transfer import nixl

    for mod in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(TransferError, match="pip install --no-deps nixl-cu13"):
        nixl.NixlBackend()
