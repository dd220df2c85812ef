"""Which address a worker binds and advertises (cluster/node_address.py).

Spec:
- `node_ip` answers, first that is set: the config's advertise_host, $K3SERVE_HOST_IP, the Ray
  node IP of this process's node (Ray running), else 127.0.0.1.
- Whatever it answers is an IP literal a peer can dial: a name or the unspecified address is
  refused with the setting's name, from the config and from the environment alike.
- `advertise_host` is refused for the local launcher (one machine, 127.0.0.1).
- Mooncake's agent is told the address (its hostname); NIXL and local need none.
- A decode control server binds only an IP literal a peer can dial, by the same check: never the
  unspecified address (all interfaces, undialable), nor a name; an IPv6 one is bracketed in its
  address.
"""

from __future__ import annotations


import pydantic
import pytest
ray = pytest.importorskip("ray")  # a test extra; the GPU machine has none

from k3serve.cluster.config import ServeConfig
from k3serve.cluster.node_address import HOST_IP_ENV, node_ip
from k3serve.transfer.backend import TransferError
from k3serve.transfer.backends import host_options
from k3serve.transfer.auth import new_secret
from k3serve.transfer.control import ControlPlaneError, DecodeControlServer
from k3serve.cluster.local_ray import start_local_ray


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HOST_IP_ENV, raising=False)


@pytest.fixture(scope="module")
def ray_node() -> str:
    """A one-node Ray cluster in this process; its node's address as Ray's GCS lists it."""
    local = start_local_ray(1)  # as `serve` starts it; its session folder removed at the end
    try:
        (node,) = ray.nodes()
        yield node["NodeManagerAddress"]
    finally:
        local.stop()


def test_without_ray_or_settings_it_is_loopback(no_env: None) -> None:
    assert not ray.is_initialized()
    assert node_ip() == "127.0.0.1"


def test_env_wins_over_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_IP_ENV, "10.1.2.3")
    assert node_ip() == "10.1.2.3"


def test_config_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_IP_ENV, "10.1.2.3")
    assert node_ip("10.9.8.7") == "10.9.8.7"
    assert node_ip("fd00::7") == "fd00::7"


def test_in_ray_it_is_the_ray_node_ip(ray_node: str, no_env: None) -> None:
    assert node_ip() == ray_node


def test_env_and_config_win_over_ray(ray_node: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_IP_ENV, "10.1.2.3")
    assert node_ip() == "10.1.2.3"
    assert node_ip("10.9.8.7") == "10.9.8.7"


@pytest.mark.parametrize("bad", ["node-a.example", "0.0.0.0", "::", "10.0.0.300"])
def test_what_a_peer_cannot_dial_is_refused(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="advertise_host"):
        node_ip(bad)
    monkeypatch.setenv(HOST_IP_ENV, bad)
    with pytest.raises(ValueError, match=HOST_IP_ENV):
        node_ip()
    with pytest.raises(pydantic.ValidationError, match="advertise_host"):
        ServeConfig(advertise_host=bad)


def test_config_accepts_an_ip_for_ray_and_refuses_it_for_one_machine_layouts() -> None:
    assert ServeConfig(advertise_host="192.0.2.2").advertise_host == "192.0.2.2"
    with pytest.raises(pydantic.ValidationError, match="launcher"):
        ServeConfig(advertise_host="192.0.2.2", launcher="local", transfer="local")
    with pytest.raises(pydantic.ValidationError, match="colocated"):
        ServeConfig(advertise_host="192.0.2.2", mode="colocated")


def test_mooncake_is_told_the_address_the_others_need_none() -> None:
    assert host_options("mooncake", "10.1.2.3") == {"hostname": "10.1.2.3"}
    assert host_options("nixl", "10.1.2.3") == {}
    assert host_options("local", "10.1.2.3") == {}
    with pytest.raises(TransferError, match="unknown transfer backend"):
        host_options("rdma", "10.1.2.3")


@pytest.mark.parametrize("unspecified", ["0.0.0.0", "::", "[::]"])
def test_a_decode_control_server_refuses_to_listen_everywhere(unspecified: str) -> None:
    with pytest.raises(ValueError, match="DecodeControlServer host=.* is the unspecified address"):
        DecodeControlServer(object(), "compat", host=unspecified, secret=new_secret())


def test_a_decode_control_server_refuses_a_name() -> None:
    with pytest.raises(ValueError, match="DecodeControlServer host='localhost' is not an IP address"):
        DecodeControlServer(object(), "compat", host="localhost", secret=new_secret())


def test_a_decode_control_server_on_ipv6_publishes_a_bracketed_address() -> None:
    server = DecodeControlServer(object(), "compat", host="[::1]", secret=new_secret())
    assert server.host == "::1"
    try:
        server.start()
    except ControlPlaneError:
        pytest.skip("this host has no IPv6 loopback to bind")
    try:
        assert server.address == f"[::1]:{server.port}"
    finally:
        server.stop()
