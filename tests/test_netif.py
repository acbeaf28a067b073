"""Interface listing, NCCL_SOCKET_IFNAME-style specs, and the choice of interface."""
from __future__ import annotations

import pytest

from linkwise.errors import BootstrapError
from linkwise.netif import (IfnameSpec, Interface, is_bogus, list_interfaces, matches,
                            parse_ifname_spec, select_interface)

I = Interface
GPU_VM = [I("lo", "127.0.0.1"), I("ifb0", "", False), I("ifb1", "", False), I("eth0", "10.0.0.5")]
DOCKER_TRAP = [I("lo", "127.0.0.1"), I("docker0", "172.17.0.1"), I("eth0", "10.1.2.3")]


@pytest.mark.parametrize("spec, parsed", [
    ("eth", IfnameSpec(("eth",))),
    ("eth,ib", IfnameSpec(("eth", "ib"))),
    ("^docker,lo", IfnameSpec(("docker", "lo"), exclude=True)),
    ("=eth0", IfnameSpec(("eth0",), exact=True)),
    ("^=docker0, lo", IfnameSpec(("docker0", "lo"), exclude=True, exact=True)),
])
def test_parse_spec(spec, parsed):
    assert parse_ifname_spec(spec) == parsed


@pytest.mark.parametrize("bad", ["", "^", "=", "^=", " , "])
def test_parse_spec_rejects_empty(bad):
    with pytest.raises(ValueError, match="names no interface"):
        parse_ifname_spec(bad)


def test_matches():
    assert matches(parse_ifname_spec("eth"), "eth10")
    assert not matches(parse_ifname_spec("=eth"), "eth10")
    assert matches(parse_ifname_spec("=eth0"), "eth0")
    assert not matches(parse_ifname_spec("^docker,lo"), "docker0")
    assert not matches(parse_ifname_spec("^docker,lo"), "lo")
    assert matches(parse_ifname_spec("^docker,lo"), "eth0")
    assert matches(parse_ifname_spec("^=docker0"), "docker01")
    assert not matches(parse_ifname_spec("^=docker0"), "docker0")


def test_gpu_vm_picks_eth0():
    assert select_interface("", GPU_VM).name == "eth0"
    # Even if the ifb devices were up with addresses, they are not for traffic.
    up_ifb = [I("lo", "127.0.0.1"), I("ifb0", "10.9.9.9"), I("ifb1", "10.9.9.8"), I("eth0", "10.0.0.5")]
    assert select_interface("", up_ifb).name == "eth0"


def test_docker_trap():
    assert select_interface("", DOCKER_TRAP).name == "eth0"
    assert select_interface("", list(reversed(DOCKER_TRAP))).name == "eth0"


@pytest.mark.parametrize("names, want", [
    (["lo", "eth0", "ib0"], "ib0"),
    (["lo", "wlan0", "enp3s0"], "enp3s0"),
    (["veth12ab", "virbr0", "br-0a1b", "dummy0", "wlan0"], "wlan0"),
    (["eth1", "eth0"], "eth1"),  # equal preference: kernel order
])
def test_default_preference(names, want):
    ifaces = [I(n, f"10.0.0.{k + 1}") for k, n in enumerate(names)]
    assert select_interface("", ifaces).name == want


def test_skips_down_and_addressless():
    ifaces = [I("eth0", "10.0.0.1", up=False), I("eth1", ""), I("ens5", "10.0.0.3")]
    assert select_interface("", ifaces).name == "ens5"


def test_loopback_only_with_warning():
    with pytest.warns(RuntimeWarning, match="loopback"):
        assert select_interface("", [I("lo", "127.0.0.1"), I("docker0", "172.17.0.1")]).name == "lo"
    with pytest.raises(BootstrapError, match="LINKWISE_SOCKET_IFNAME"):
        select_interface("", [I("eth0", "")])


def test_spec_chooses():
    assert select_interface("=docker0", DOCKER_TRAP).name == "docker0"
    assert select_interface("^docker,lo", DOCKER_TRAP).name == "eth0"
    assert select_interface("lo", DOCKER_TRAP).name == "lo"
    # An exclusion spec still ranks loopback and bridges last.
    assert select_interface("^=docker0", DOCKER_TRAP).name == "eth0"
    with pytest.raises(BootstrapError, match=r"'ib'.*eth0=10\.1\.2\.3"):
        select_interface("ib", DOCKER_TRAP)


def test_spec_from_environment(monkeypatch):
    monkeypatch.setenv("LINKWISE_SOCKET_IFNAME", "=docker0")
    assert select_interface(interfaces=DOCKER_TRAP).name == "docker0"
    monkeypatch.setenv("LINKWISE_SOCKET_IFNAME", "")
    assert select_interface(interfaces=DOCKER_TRAP).name == "eth0"


def test_is_bogus():
    for n in ("lo", "docker0", "veth0a", "virbr0", "br-abc", "ifb0", "cali123"):
        assert is_bogus(n)
    for n in ("eth0", "ib0", "enp1s0", "bond0", "wlan0"):
        assert not is_bogus(n)


def test_list_interfaces_on_this_host(monkeypatch):
    ifaces = list_interfaces()
    lo = [i for i in ifaces if i.name == "lo"]
    assert lo and lo[0].address == "127.0.0.1" and lo[0].up
    for i in ifaces:
        assert i.address == "" or i.address.count(".") == 3
    monkeypatch.delenv("LINKWISE_SOCKET_IFNAME", raising=False)
    chosen = select_interface()
    if any(not is_bogus(i.name) and i.address and i.up for i in ifaces):
        assert not is_bogus(chosen.name)
