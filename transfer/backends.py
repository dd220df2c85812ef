"""Pick a transfer backend by name. Every backend's package is imported only when it is made, so a
host needs only the packages of the backend it runs:

    make_backend("mooncake", hostname="10.0.0.5", protocol="rdma")   # MooncakeBackend
    make_backend("nixl")                                             # NixlBackend (UCX)
    make_backend("local")                                            # LocalBackend (one process)
    make_backend("mooncake", **host_options("mooncake", node_ip))    # reachable at this node's IP
    available_backends()  -> {"local": True, "mooncake": True, "nixl": False}
"""

from __future__ import annotations

import importlib
import importlib.util

from .backend import TransferBackend, TransferError

# name -> (module, class); modules are relative to this package.
_BACKENDS: dict[str, tuple[str, str]] = {
    "mooncake": ("mooncake", "MooncakeBackend"),
    "nixl": ("nixl", "NixlBackend"),
    "local": ("local", "LocalBackend"),
}

# What each backend needs importable beyond k3serve itself (checked by available_backends()).
_REQUIRES: dict[str, tuple[tuple[str, ...], ...]] = {
    "mooncake": (("mooncake.engine",),),
    "nixl": (("nixl_cu13._api", "nixl_cu12._api", "nixl._api"),),  # any one of them
    "local": (),
}


# The constructor option through which a backend's agent tells peers its node's address; None: it
# finds its interfaces itself (NIXL: UCX puts every usable one in the agent's metadata).
_HOST_OPTION: dict[str, str | None] = {"mooncake": "hostname", "nixl": None, "local": None}


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def make_backend(name: str, **options) -> TransferBackend:
    """A new backend agent. `options` go to the backend's constructor (see its class docstring).
    TransferError for an unknown name, or (from the backend) when its package is missing."""
    key = _key(name)
    module, cls = _BACKENDS[key]
    try:
        mod = importlib.import_module(f".{module}", __package__)
    except ImportError as e:
        raise TransferError(f"transfer backend {key!r} could not be loaded: {e}") from e
    return getattr(mod, cls)(**options)


def host_options(name: str, host: str) -> dict[str, str]:
    """The `make_backend(name, ...)` options that make its agent reachable at `host`, this node's
    address (Mooncake's hostname defaults to 127.0.0.1, which no other node can dial)."""
    option = _HOST_OPTION[_key(name)]
    return {option: host} if option else {}


def _key(name: str) -> str:
    key = name.strip().lower()
    if key not in _BACKENDS:
        raise TransferError(f"unknown transfer backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    return key


def _importable(module: str) -> bool:
    """True if `module` imports. Actually imports it (a spec lookup would miss a wheel whose shared
    library fails to load, as Mooncake's does without libibverbs.so.1 or, for the CUDA builds,
    without a GPU driver); never raises."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def available_backends() -> dict[str, bool]:
    """Which backends can be made on this host (their packages import), without failing."""
    out = {}
    for name in _BACKENDS:
        module, _ = _BACKENDS[name]
        ok = importlib.util.find_spec(f"{__package__}.{module}") is not None
        for alternatives in _REQUIRES[name]:
            ok = ok and any(_importable(m) for m in alternatives)
        out[name] = ok
    return out
