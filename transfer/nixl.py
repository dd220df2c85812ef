"""NIXL backend (UCX): one-sided writes between agents, with a notification to the target.

Install with `pip install --no-deps nixl-cu13==1.5.1` (or nixl-cu12); imported lazily. UCX defaults are set
only when unset (TCP_NODELAY when TCP may be used; no peer error handling for intra-host-only transports), and
the progress thread sleeps `progress_delay_us` between rounds instead of busy-polling a core.
`write(..., notify=msg)` delivers `msg` once every op of the batch landed (a batch of mixed memory kinds sends
it from poll()); the target reads `get_notifications()`. Setup and reasoning: docs/design/handoff.md §7.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from ._ops import Deadline, HandleTable, RegionIndex, check_ops, prefault, tensor_region
from .backend import AgentInfo, RegionDesc, TransferBackend, TransferError, TransferStatus, WriteOp

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "the NIXL backend needs the NIXL Python package: `pip install --no-deps nixl-cu13==1.5.1` "
    "(or nixl-cu12; --no-deps keeps pip from pulling a CUDA torch; numpy must be installed)"
)
_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")
# UCX transports that only reach the same host; UCX_TLS made of these alone needs error handling off.
_INTRA_HOST_TLS = {
    "self", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem",
    "cuda_copy", "cuda_ipc", "rocm_copy", "rocm_ipc", "gdr_copy",
}


def import_nixl_api():
    """The `nixl._api`-style module of the first installed NIXL wheel; TransferError if none."""
    errors = []
    for mod in _MODULES:
        try:
            return importlib.import_module(mod)
        except ImportError as e:
            errors.append(f"{mod}: {e}")
    raise TransferError(f"{INSTALL_HINT} (tried {'; '.join(errors)})")


def _ucx_env_defaults(params: dict[str, str]) -> None:
    tls = os.environ.get("UCX_TLS")
    norm = (tls or "").replace(" ", "").lower()
    excluded = norm.startswith("^")
    names = set(norm.lstrip("^").split(",")) - {""}
    may_use_tcp = tls is None or norm == "all" or (excluded != ("tcp" in names))
    if may_use_tcp:
        os.environ.setdefault("UCX_TCP_NODELAY", "y")
    if tls is not None and not excluded and names and names <= _INTRA_HOST_TLS:
        params.setdefault("ucx_error_handling_mode", "none")


def _make_agent(api, name: str, progress_delay_us: int):
    """A `nixl_agent` (the wrapper) whose progress thread sleeps `progress_delay_us` between rounds.

    The wrapper builds its binding agent itself, with pthrDelay = 0 and no way to change it. So it
    is built around an agent without threads or backends (cheap, dropped at once) and handed the
    binding agent made here instead: the wrapper's own settings for a config without a listener
    (progress thread on, listener off, sync mode NONE, no telemetry) but the delay.
    """
    bind = getattr(api, "nixlBind", None)
    if bind is None:
        raise TransferError(f"{api.__name__} does not expose its bindings (nixlBind): cannot set the progress "
                            f"thread's delay; {INSTALL_HINT}")
    wrapper = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    config = bind.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value
    config.pthrDelay = progress_delay_us
    config.captureTelemetry = False
    wrapper.agent = bind.nixlAgent(name, config)
    return wrapper


def _mem(device: str) -> tuple[str, int]:
    """RegionDesc.device -> (NIXL memory type, device id)."""
    if device == "cpu":
        return "DRAM", 0
    if device.startswith("cuda"):
        return "VRAM", int(device.split(":", 1)[1]) if ":" in device else 0
    raise TransferError(f"NIXL backend: unsupported device {device!r}")


@dataclass
class _Xfer:
    peer: str
    reqs: list  # nixl_xfer_handle per memory-kind group
    done: list[bool]
    deadline: Deadline
    notify: bytes | None  # still to send with send_notif (multi-group batches only)
    nbytes: int
    status: TransferStatus = TransferStatus.PENDING
    errors: list[str] = field(default_factory=list)


class NixlBackend(TransferBackend):
    """One NIXL agent with the UCX backend on one rank.

    Options:
        agent_name:     unique name (default "k3-<host>-<pid>-<random>"); AgentInfo.endpoint.
        backend:        NIXL backend plugin (default "UCX").
        backend_params: extra init parameters for the plugin (strings).
        num_threads:    UCX worker threads (0 = plugin default).
        progress_delay_us: sleep of the agent's progress thread between rounds (see the module
                        docstring; 0 = busy-poll, the wrapper's own setting).
        timeout_s:      poll() reports FAILED for a handle still pending after timeout_s plus its
                        bytes at floor_gib_s (a backstop against a peer that vanished).
    """

    name = "nixl"
    supports_notify = True

    def __init__(
        self,
        agent_name: str | None = None,
        backend: str = "UCX",
        backend_params: dict[str, str] | None = None,
        num_threads: int = 0,
        timeout_s: float = 30.0,
        floor_gib_s: float = 0.05,
        progress_delay_us: int = 100,
    ) -> None:
        if progress_delay_us < 0:
            raise ValueError(f"progress_delay_us must be >= 0, got {progress_delay_us}")
        api = import_nixl_api()
        params = {k: str(v) for k, v in (backend_params or {}).items()}
        if backend == "UCX":
            _ucx_env_defaults(params)
            if num_threads > 0:
                params.setdefault("num_threads", str(num_threads))
        self.agent_name = agent_name or f"k3-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._backend = backend
        self._timeout_s = timeout_s
        self._floor_gib_s = floor_gib_s
        try:
            self._agent = _make_agent(api, self.agent_name, progress_delay_us)
            if backend not in self._agent.get_plugin_list():
                plugins = self._agent.get_plugin_list()
                raise TransferError(f"NIXL plugin {backend!r} not found; available: {plugins}")
            self._agent.create_backend(backend, params)
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"NIXL agent {self.agent_name!r} with backend {backend} {params}: {e}") from e
        self._local = RegionIndex()
        self._tensors: dict[str, torch.Tensor] = {}
        self._reg: dict[str, object] = {}  # name -> nixlRegDList for deregister
        self._peers: dict[str, RegionIndex] = {}
        self._peer_md: dict[str, bytes] = {}
        self._handles: HandleTable[_Xfer] = HandleTable()
        self._orphans: list = []  # nixl_xfer_handle still in flight after release()
        self._closed = False

    # -- registration / handshake ------------------------------------------------------------

    def register(self, name: str, tensor: torch.Tensor) -> RegionDesc:
        self._check_open()
        if name in self._tensors:
            raise TransferError(f"region name {name!r} already registered")
        region = tensor_region(name, tensor)
        mem, dev = _mem(region.device)
        prefault(tensor)
        self._local.add(region)
        try:
            reg = self._agent.register_memory([(region.addr, region.length, dev, name)], mem, [self._backend])
        except Exception as e:
            self._local.remove(region.addr)
            raise TransferError(f"NIXL register_memory({name!r}, {region.length} bytes, {mem}): {e}") from e
        self._reg[name] = reg
        self._tensors[name] = tensor
        return region

    def agent_info(self) -> AgentInfo:
        """Call after the last register(): the metadata carries the registered memory's keys."""
        self._check_open()
        return AgentInfo(
            backend=self.name,
            endpoint=self.agent_name,
            metadata=bytes(self._agent.get_agent_metadata()),
            regions=tuple(self._local),
        )

    def connect(self, peer: AgentInfo) -> str:
        self._check_open()
        if peer.backend != self.name:
            raise TransferError(f"peer {peer.endpoint!r} runs backend {peer.backend!r}, not {self.name!r}")
        known = self._peer_md.get(peer.endpoint)
        if known is not None and known != peer.metadata:
            # Same agent, new metadata (it registered more memory): reload it.
            try:
                self._agent.remove_remote_agent(peer.endpoint)
            except Exception as e:
                log.debug("nixl: remove_remote_agent %s before reload: %s", peer.endpoint, e)
            known = None
        if known is None:
            try:
                got = self._agent.add_remote_agent(peer.metadata)
            except Exception as e:
                raise TransferError(f"NIXL add_remote_agent({peer.endpoint!r}): {e}") from e
            got = got.decode() if isinstance(got, bytes) else got
            if got != peer.endpoint:
                raise TransferError(f"NIXL metadata names agent {got!r}, AgentInfo says {peer.endpoint!r}")
            self._peer_md[peer.endpoint] = peer.metadata
        self._peers[peer.endpoint] = RegionIndex(peer.regions)
        return peer.endpoint

    # -- transfers ----------------------------------------------------------------------------

    def write(self, peer: str, ops: list[WriteOp], notify: bytes | None = None) -> int:
        self._check_open()
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r}: connect() it first")
        checked = check_ops(ops, self._local, self._peers[peer], peer)
        groups: dict[tuple[str, str], tuple[list, list]] = {}
        for op, src, dst in checked:
            (lmem, ldev), (rmem, rdev) = _mem(src.device), _mem(dst.device)
            loc, rem = groups.setdefault((lmem, rmem), ([], []))
            loc.append((op.src_addr, op.length, ldev))
            rem.append((op.dst_addr, op.length, rdev))
        single = len(groups) == 1
        nbytes = sum(op.length for op in ops)
        xfer = _Xfer(
            peer, [], [], Deadline.for_bytes(nbytes, self._timeout_s, self._floor_gib_s),
            notify=None if single else notify, nbytes=nbytes,
        )
        notif = (notify or b"") if single else b""
        try:
            for (lmem, rmem), (loc, rem) in groups.items():
                ldescs = self._agent.get_xfer_descs(np.array(loc, dtype=np.uint64), lmem)
                rdescs = self._agent.get_xfer_descs(np.array(rem, dtype=np.uint64), rmem)
                req = self._agent.initialize_xfer("WRITE", ldescs, rdescs, peer, notif, [self._backend])
                xfer.reqs.append(req)
                state = self._agent.transfer(req)
                if state == "ERR":
                    raise TransferError(f"NIXL transfer() to {peer!r} returned ERR (peer unreachable?)")
                xfer.done.append(state == "DONE")
        except Exception as e:
            self._drop_reqs(xfer)
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"NIXL write to {peer!r} ({len(ops)} ops, {nbytes} bytes): {e}") from e
        return self._handles.add(xfer)

    def poll(self, handle: int) -> TransferStatus:
        xfer = self._get(handle)
        if xfer.status is not TransferStatus.PENDING:
            return xfer.status
        pending = False
        for i, req in enumerate(xfer.reqs):
            if xfer.done[i]:
                continue
            try:
                state = self._agent.check_xfer_state(req)
            except Exception as e:
                state = "ERR"
                xfer.errors.append(str(e))
            if state == "DONE":
                xfer.done[i] = True
            elif state == "PROC":
                pending = True
            else:
                xfer.done[i] = True
                xfer.errors.append(f"request {i}: {state}")
        if xfer.errors:
            xfer.status = TransferStatus.FAILED
            log.warning("nixl: write to %s failed: %s", xfer.peer, "; ".join(xfer.errors[:3]))
        elif not pending:
            if xfer.notify is not None:
                try:
                    self._agent.send_notif(xfer.peer, xfer.notify, self._backend)
                except Exception as e:
                    xfer.status = TransferStatus.FAILED
                    xfer.errors.append(f"notification failed: {e}")
                    log.warning("nixl: notification to %s failed: %s", xfer.peer, e)
                    return xfer.status
                xfer.notify = None
            xfer.status = TransferStatus.DONE
        elif xfer.deadline.passed():
            xfer.status = TransferStatus.FAILED
            xfer.errors.append("still pending at its deadline")
            log.warning("nixl: write to %s (%d bytes) still pending at its deadline", xfer.peer, xfer.nbytes)
        self._reap_orphans()
        return xfer.status

    def release(self, handle: int) -> None:
        xfer = self._handles.pop(handle)
        if xfer is not None:
            self._drop_reqs(xfer)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        """(sender agent name, payload) of every notification that arrived since the last call
        (target side); same shape as LocalBackend.get_notifications()."""
        self._check_open()
        out: list[tuple[str, bytes]] = []
        for sender, msgs in self._agent.get_new_notifs().items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            out.extend((name, bytes(m)) for m in msgs)
        return out

    def error(self, handle: int) -> str:
        """Why a FAILED handle failed ('' otherwise)."""
        return "; ".join(self._get(handle).errors)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._handles.handles():
            self.release(h)
        self._reap_orphans()
        for name, reg in self._reg.items():
            try:
                self._agent.deregister_memory(reg, [self._backend])
            except Exception as e:  # pragma: no cover - best effort at shutdown
                log.debug("nixl: deregister %s: %s", name, e)
        for peer in self._peers:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as e:  # pragma: no cover
                log.debug("nixl: remove_remote_agent %s: %s", peer, e)
        self._reg.clear()
        self._tensors.clear()
        self._peers.clear()
        self._peer_md.clear()
        self._local = RegionIndex()
        self._agent = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- internals ----------------------------------------------------------------------------

    def _drop_reqs(self, xfer: _Xfer) -> None:
        """Release NIXL requests; one still in flight cannot always be cancelled (release raises):
        keep it and retry from later poll() calls."""
        for req in xfer.reqs:
            try:
                self._agent.release_xfer_handle(req)
            except Exception:
                self._orphans.append(req)
        xfer.reqs = []

    def _reap_orphans(self) -> None:
        if not self._orphans:
            return
        keep = []
        for req in self._orphans:
            try:
                if self._agent.check_xfer_state(req) == "PROC":
                    keep.append(req)
                    continue
                self._agent.release_xfer_handle(req)
            except Exception:
                pass
        self._orphans = keep

    def _get(self, handle: int) -> _Xfer:
        self._check_open()
        return self._handles.get(handle)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("nixl backend is closed")
