"""IP literals that servers bind on and peers dial: the checks and formatting that a TP group's
rendezvous (`engine/tp_group.py`), the decode control server (`transfer/control.py`) and the
deployment's choice of address (`cluster/node_address.py`) share. Here, below all three, so that
neither engine/ nor transfer/ imports cluster/."""

from __future__ import annotations

import ipaddress


def check_host_ip(value: str, what: str) -> str:
    """`value` if it is an IP address a peer can dial; ValueError naming `what` otherwise."""
    try:
        ip = ipaddress.ip_address(value.strip())
    except ValueError:
        raise ValueError(f"{what}={value!r} is not an IP address: give this node's address "
                         "(e.g. the pod IP), which its workers bind on and advertise") from None
    if ip.is_unspecified:
        raise ValueError(f"{what}={value!r} is the unspecified address: peers cannot dial it; give this node's address")
    return str(ip)


def uri_host(host: str) -> str:
    """`host` as it goes before `:port` in an address or URI (an IPv6 literal in brackets)."""
    return f"[{host}]" if ":" in host else host
