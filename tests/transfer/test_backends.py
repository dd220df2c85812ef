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
