"""The backend factory: names, lazy imports, availability report."""

from __future__ import annotations

import pytest

from k3serve.transfer.backend import TransferBackend, TransferError
from k3serve.transfer.backends import available_backends, backend_names, make_backend


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(TransferError, match="unknown transfer backend 'rdma'.*mooncake, nixl, local"):
        make_backend("rdma")


def test_available_backends_never_raises() -> None:
    avail = available_backends()
    assert set(avail) == set(backend_names()) == {"mooncake", "nixl", "local"}
    assert all(isinstance(v, bool) for v in avail.values())


@pytest.mark.parametrize("name", ["mooncake", "nixl"])
def test_make_backend(name: str) -> None:
    if not available_backends()[name]:
        pytest.skip(f"{name} package not installed")
    b = make_backend(name.upper(), timeout_s=5)
    try:
        assert isinstance(b, TransferBackend) and b.name == name
    finally:
        b.close()


def test_unknown_mooncake_protocol_is_refused_instead_of_falling_back_to_tcp() -> None:
    """Mooncake itself logs an unknown protocol and runs TCP anyway (seen with its CUDA and CPU builds);
    refused before Mooncake is imported, so this holds on any host."""
    from k3serve.transfer.mooncake import MooncakeBackend

    with pytest.raises(ValueError, match="nvlink_intra"):
        MooncakeBackend(protocol="nvlnk")


def test_mooncake_protocol_cannot_mix_with_intranode_nvlink(monkeypatch: pytest.MonkeyPatch) -> None:
    """MC_INTRANODE_NVLINK switches every engine of the process to intra-node NVLink: a TCP engine there
    would silently not be one."""
    from k3serve.transfer.mooncake import MooncakeBackend

    monkeypatch.setenv("MC_INTRANODE_NVLINK", "1")
    with pytest.raises(ValueError, match="MC_INTRANODE_NVLINK"):
        MooncakeBackend(protocol="tcp")
