"""Mooncake Transfer Engine backend: one-sided writes over TCP (CPU hosts) or RDMA / NVLink (GPU hosts).

The package is imported lazily (`INSTALL_HINT` says which one a host needs). A peer is "host:rpc_port"
(P2P handshake, no metadata server). write() submits and returns at once; poll() never waits, and checks a
Mooncake request no more once it reported a final state (Mooncake has freed it then). No completion
notification (`supports_notify` False): completion goes over the control plane. Setup and reasoning:
docs/design/handoff.md §7.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from ._ops import Deadline, HandleTable, RegionIndex, check_ops, coalesce, prefault, tensor_region
from .backend import AgentInfo, RegionDesc, TransferBackend, TransferError, TransferStatus, WriteOp

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "the Mooncake backend needs the Mooncake Transfer Engine Python package: on a CPU host "
    "`pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`, on a CUDA 13 host "
    "`pip install mooncake-transfer-engine-cuda13`; both also need the system library "
    "libibverbs.so.1 (`apt-get install -y libibverbs1`)"
)

PROTOCOLS = ("tcp", "rdma", "nvlink", "nvlink_intra")  # those this backend passes to Mooncake
_INTRANODE_ENV = "MC_INTRANODE_NVLINK"  # process-wide: Mooncake then uses intra-node NVLink for every engine

# transfer_check_status return codes
_MC_DONE, _MC_PENDING, _MC_FAILED, _MC_TIMEOUT = 1, 0, -1, -2


def _import_engine():
    try:
        from mooncake.engine import TransferEngine  # noqa: PLC0415 - lazy by design
    except ImportError as e:  # also raised when libibverbs.so.1 (or a CUDA driver) is missing
        raise TransferError(f"{INSTALL_HINT} (import failed: {e})") from e
    return TransferEngine


@dataclass
class _Batch:
    peer: str
    ids: list[int]  # one Mooncake batch id per submitted request
    done: list[bool]  # final state cached: a finished id is freed by Mooncake, never re-check it
    deadline: Deadline
    status: TransferStatus = TransferStatus.PENDING
    nbytes: int = 0
    errors: list[str] = field(default_factory=list)


class MooncakeBackend(TransferBackend):
    """One Mooncake TransferEngine on one rank.

    Options:
        hostname:    address peers use to reach this engine (default 127.0.0.1: one machine);
                     across hosts this node's IP (`backends.host_options`; the Ray launcher
                     passes each worker's node IP, cluster/node_address.py).
        protocol:    "tcp" (default; CPU hosts), "rdma", "nvlink" (multi-node NVLink fabric) or
                     "nvlink_intra" (GPUs of one host: Mooncake's IntraNodeNvlinkTransport, which it
                     selects by the process-wide MC_INTRANODE_NVLINK=1 that this option sets). Any other
                     name is refused here: Mooncake logs an unknown protocol and carries on over TCP.
        device_name: RDMA NIC filter, e.g. "mlx5_0,mlx5_1" ("" = auto-discover).
        timeout_s:   poll() reports FAILED for a handle still pending after timeout_s plus its
                     bytes at floor_gib_s (a backstop; Mooncake's own timeout is
                     MC_TRANSFER_TIMEOUT, default 30 s, minimum 5 s).
        coalesce:    merge ops contiguous on both sides into one request (default True).
    """

    name = "mooncake"
    supports_notify = False

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        timeout_s: float = 30.0,
        floor_gib_s: float = 0.05,
        coalesce: bool = True,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"Mooncake protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
        if protocol == "nvlink_intra":
            os.environ[_INTRANODE_ENV] = "1"
        elif os.environ.get(_INTRANODE_ENV):
            raise ValueError(f"Mooncake protocol {protocol!r} in a process where {_INTRANODE_ENV} is set: Mooncake "
                             "would use intra-node NVLink instead; one protocol per process")
        engine_cls = _import_engine()
        self.hostname = hostname
        self.protocol = protocol
        self._timeout_s = timeout_s
        self._floor_gib_s = floor_gib_s
        self._coalesce = coalesce
        self._engine = engine_cls()
        ret = self._engine.initialize(hostname, metadata_server, protocol, device_name)
        if ret != 0:
            raise TransferError(
                f"Mooncake initialize({hostname!r}, {metadata_server!r}, {protocol!r}, {device_name!r}) "
                f"returned {ret}: check the protocol is built into this package (non-cuda: tcp only) "
                "and the NIC / hostname exist"
            )
        self.endpoint = f"{hostname}:{self._engine.get_rpc_port()}"
        self._local = RegionIndex()
        self._tensors: dict[str, torch.Tensor] = {}
        self._peers: dict[str, RegionIndex] = {}
        self._handles: HandleTable[_Batch] = HandleTable()
        self._orphans: list[int] = []  # batch ids of released-but-unfinished handles, reaped later
        self._closed = False
        self._warned_notify = False

    # -- registration / handshake ------------------------------------------------------------

    def register(self, name: str, tensor: torch.Tensor) -> RegionDesc:
        self._check_open()
        if name in self._tensors:
            raise TransferError(f"region name {name!r} already registered")
        region = tensor_region(name, tensor)
        prefault(tensor)
        self._local.add(region)
        ret = self._engine.register_memory(region.addr, region.length)
        if ret != 0:
            self._local.remove(region.addr)
            raise TransferError(f"Mooncake register_memory({name!r}, {region.length} bytes) returned {ret}")
        self._tensors[name] = tensor
        return region

    def agent_info(self) -> AgentInfo:
        self._check_open()
        return AgentInfo(backend=self.name, endpoint=self.endpoint, metadata=b"", regions=tuple(self._local))

    def connect(self, peer: AgentInfo) -> str:
        """Record the peer's regions. Mooncake opens the TCP/RDMA segment lazily on the first write
        (P2P handshake with the peer's RPC port), so nothing is contacted here."""
        self._check_open()
        if peer.backend != self.name:
            raise TransferError(f"peer {peer.endpoint!r} runs backend {peer.backend!r}, not {self.name!r}")
        self._peers[peer.endpoint] = RegionIndex(peer.regions)
        return peer.endpoint

    # -- transfers ----------------------------------------------------------------------------

    def write(self, peer: str, ops: list[WriteOp], notify: bytes | None = None) -> int:
        self._check_open()
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r}: connect() it first")
        if notify is not None and not self._warned_notify:
            log.info("mooncake: notify ignored (no notifications); completion goes over the control plane")
            self._warned_notify = True
        checked = check_ops(ops, self._local, self._peers[peer], peer)
        reqs = coalesce([op for op, _, _ in checked]) if self._coalesce else [op for op, _, _ in checked]
        nbytes = sum(op.length for op in reqs)
        batch = _Batch(peer, [], [], Deadline.for_bytes(nbytes, self._timeout_s, self._floor_gib_s), nbytes=nbytes)
        for op in reqs:
            bid = self._engine.transfer_submit_write(peer, op.src_addr, op.dst_addr, op.length)
            if bid <= 0:
                # Mooncake could not open the peer's segment or submit. 0.3.13 returns 0 here (not
                # the documented -1), and checking batch id 0 segfaults: never poll it.
                # Requests submitted before it may be in flight; keep them so they get reaped.
                self._orphans.extend(batch.ids)
                raise TransferError(
                    f"Mooncake transfer_submit_write to {peer!r} returned {bid}: the peer is not reachable "
                    "(exited, wrong endpoint, or its RPC port is blocked)"
                )
            batch.ids.append(bid)
            batch.done.append(False)
        return self._handles.add(batch)

    def poll(self, handle: int) -> TransferStatus:
        batch = self._get(handle)
        if batch.status is not TransferStatus.PENDING:
            return batch.status
        pending = False
        for i, bid in enumerate(batch.ids):
            if batch.done[i]:
                continue
            rc = self._engine.transfer_check_status(bid)
            if rc == _MC_DONE:
                batch.done[i] = True
            elif rc == _MC_PENDING:
                pending = True
            else:
                batch.done[i] = True  # -1: freed by Mooncake; -2 (timeout): not freed, nothing to do
                batch.errors.append(f"request {i}: {'timed out' if rc == _MC_TIMEOUT else f'failed ({rc})'}")
        if batch.errors:
            batch.status = TransferStatus.FAILED
            log.warning("mooncake: write to %s failed: %s", batch.peer, "; ".join(batch.errors[:3]))
            self._orphan_pending(batch)
        elif not pending:
            batch.status = TransferStatus.DONE
        elif batch.deadline.passed():
            batch.status = TransferStatus.FAILED
            batch.errors.append("still pending at its deadline")
            log.warning("mooncake: write to %s (%d bytes) still pending at its deadline", batch.peer, batch.nbytes)
            self._orphan_pending(batch)
        self._reap_orphans()
        return batch.status

    def release(self, handle: int) -> None:
        batch = self._handles.pop(handle)
        if batch is not None and batch.status is TransferStatus.PENDING:
            self._orphan_pending(batch)

    def error(self, handle: int) -> str:
        """Why a FAILED handle failed ('' otherwise)."""
        return "; ".join(self._get(handle).errors)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._handles = HandleTable()
        for region in list(self._local):
            try:
                self._engine.unregister_memory(region.addr)
            except Exception as e:  # pragma: no cover - best effort at shutdown
                log.debug("mooncake: unregister %s: %s", region.name, e)
        self._tensors.clear()
        self._peers.clear()
        self._local = RegionIndex()
        # Dropping the engine stops its threads and closes its sockets.
        self._engine = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- internals ----------------------------------------------------------------------------

    def _orphan_pending(self, batch: _Batch) -> None:
        """Requests still in flight keep their Mooncake batch until checked to a final state
        (which frees it); keep checking them from later poll() calls."""
        for i, bid in enumerate(batch.ids):
            if not batch.done[i]:
                batch.done[i] = True
                self._orphans.append(bid)

    def _reap_orphans(self) -> None:
        if not self._orphans:
            return
        self._orphans = [bid for bid in self._orphans if self._engine.transfer_check_status(bid) == _MC_PENDING]

    def _get(self, handle: int) -> _Batch:
        self._check_open()
        return self._handles.get(handle)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("mooncake backend is closed")

