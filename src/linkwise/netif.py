"""Network interfaces, and which one carries cross-host TCP traffic.

:func:`list_interfaces` reads this host's interfaces and their IPv4 addresses (Linux ioctls,
no extra dependencies). The rest are pure functions of an interface list, so they are tested
with made-up machines:

* :func:`parse_ifname_spec` reads ``LINKWISE_SOCKET_IFNAME`` with NCCL_SOCKET_IFNAME's syntax:
  ``eth,ib`` prefixes, ``^docker,lo`` excluded prefixes, ``=eth0`` exact names, ``^=docker0``
  excluded exact names.
* :func:`select_interface` picks one: with a spec, the best interface it admits; without one,
  never loopback or virtual/bridge interfaces (docker*, veth*, virbr*, br-*, ifb*, ...),
  preferring ib*, then eth*/en*, then the rest; loopback only as a last resort, with a warning.
"""
from __future__ import annotations

import fcntl
import socket
import struct
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

from . import config
from .errors import BootstrapError

__all__ = ["Interface", "IfnameSpec", "list_interfaces", "parse_ifname_spec", "matches",
           "is_bogus", "select_interface"]

# Virtual interfaces that never reach another host (or not reliably): container bridges and
# veth pairs, libvirt/VirtualBox/VMware host bridges, traffic-shaping ifb, dummies, CNI plumbing.
BOGUS_PREFIXES = ("lo", "docker", "veth", "virbr", "br-", "ifb", "dummy", "vboxnet", "vmnet",
                  "lxcbr", "lxdbr", "cni", "flannel", "cali", "kube-ipvs", "podman", "nerdctl")

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1


@dataclass(frozen=True)
class Interface:
    """A network interface; ``address`` is its IPv4 address ("" when it has none)."""
    name: str
    address: str
    up: bool = True


@dataclass(frozen=True)
class IfnameSpec:
    """A parsed NCCL_SOCKET_IFNAME-style spec: ``names`` are prefixes unless ``exact``;
    ``exclude`` inverts the match."""
    names: tuple[str, ...]
    exclude: bool = False
    exact: bool = False


def _ioctl_ifreq(sock: socket.socket, request: int, name: str) -> Optional[bytes]:
    ifreq = struct.pack("256s", name.encode()[:15])
    try:
        return fcntl.ioctl(sock.fileno(), request, ifreq)
    except OSError:
        return None


def list_interfaces() -> list[Interface]:
    """This host's interfaces in kernel index order, with IPv4 address and up flag."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            res = _ioctl_ifreq(sock, _SIOCGIFADDR, name)
            addr = socket.inet_ntoa(res[20:24]) if res else ""
            flags = _ioctl_ifreq(sock, _SIOCGIFFLAGS, name)
            up = bool(struct.unpack_from("H", flags, 16)[0] & _IFF_UP) if flags else False
            out.append(Interface(name, addr, up))
    return out


def parse_ifname_spec(spec: str) -> IfnameSpec:
    """Parse ``[^][=]name[,name...]``; raises ValueError for an empty name list."""
    s = spec.strip()
    exclude = s.startswith("^")
    if exclude:
        s = s[1:]
    exact = s.startswith("=")
    if exact:
        s = s[1:]
    names = tuple(n.strip() for n in s.split(",") if n.strip())
    if not names:
        raise ValueError(f"interface spec {spec!r} names no interface; examples: 'eth', "
                         f"'^docker,lo', '=eth0', '^=docker0'")
    return IfnameSpec(names, exclude, exact)


def matches(spec: IfnameSpec, name: str) -> bool:
    """Whether ``spec`` admits the interface called ``name``."""
    hit = any((name == n) if spec.exact else name.startswith(n) for n in spec.names)
    return hit != spec.exclude


def is_bogus(name: str) -> bool:
    """Loopback or a virtual interface that does not lead to other hosts."""
    return name.startswith(BOGUS_PREFIXES)


def _preference(iface: Interface) -> int:
    n = iface.name
    if n.startswith("lo"):
        return 5
    if is_bogus(n):
        return 4
    if n.startswith("ib"):
        return 0
    if n.startswith(("eth", "en")):
        return 1
    return 2


def _usable(ifaces: Sequence[Interface]) -> list[Interface]:
    return [i for i in ifaces if i.address and i.up]


def select_interface(spec: Optional[str] = None,
                     interfaces: Optional[Sequence[Interface]] = None) -> Interface:
    """The interface for cross-host TCP traffic.

    ``spec`` defaults to ``LINKWISE_SOCKET_IFNAME``; ``interfaces`` to :func:`list_interfaces`.
    Only interfaces that are up and have an IPv4 address count. Raises BootstrapError when the
    spec admits none, or when the host has no usable interface at all."""
    if spec is None:
        spec = config.get("LINKWISE_SOCKET_IFNAME")
    ifaces = list_interfaces() if interfaces is None else list(interfaces)
    usable = _usable(ifaces)
    # Stable sort keeps kernel order among interfaces of equal preference.
    if spec and spec.strip():
        parsed = parse_ifname_spec(spec)
        chosen = sorted((i for i in usable if matches(parsed, i.name)), key=_preference)
        if not chosen:
            have = ", ".join(f"{i.name}={i.address or 'no IPv4'}" for i in ifaces) or "none"
            raise BootstrapError(f"LINKWISE_SOCKET_IFNAME={spec!r} matches no interface that is "
                                 f"up with an IPv4 address (this host has: {have}); fix the spec")
        return chosen[0]
    good = sorted((i for i in usable if not is_bogus(i.name)), key=_preference)
    if good:
        return good[0]
    loop = [i for i in usable if i.name.startswith("lo")]
    if loop:
        warnings.warn(f"linkwise: no network interface besides loopback; using {loop[0].name} "
                      f"({loop[0].address}), so other hosts cannot connect", RuntimeWarning,
                      stacklevel=2)
        return loop[0]
    raise BootstrapError("no usable network interface (up, with an IPv4 address); set "
                         "LINKWISE_SOCKET_IFNAME to the interface that reaches the other hosts")
