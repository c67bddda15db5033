"""Emulated hosts for tests: one Linux network namespace per host, joined by veth pairs on a
bridge in a namespace of its own, each host with its own address on a private subnet and
its own loopback. Nothing is added to the machine's own network namespace.

``emulated_hosts("a", "b", ...)`` (a pytest fixture in conftest.py) makes a :class:`Network`; every
process started with :meth:`Host.start` and every namespace is removed when the test ends,
passed or failed. Names carry a random suffix, so parallel or leftover runs never clash.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

from child_processes import RoleProcess, stop_all

SUBNET = "10.77.0"
"""The hosts' /24: host i (from 0) is SUBNET.(i + 1)."""
HOST_IFACE = "eth0"
"""The name of each host's link to the bridge, inside its namespace."""
NOWHERE_MAC = "02:00:00:00:00:99"
"""A locally administered address no interface has: frames sent to it are dropped."""


class NamespacesUnavailable(RuntimeError):
    """This machine cannot make the namespaces (not root, no ``ip``, or the kernel refuses)."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NamespacesUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


@dataclass
class Host:
    name: str
    """Label of the host in the test (e.g. ``"a"``)."""
    namespace: str
    ip: str
    switch_port: str
    """The other end of the host's veth pair, on the bridge (in the switch namespace)."""
    processes: list[RoleProcess] = field(default_factory=list)

    def start(self, command: list[str], env: dict[str, str] | None = None) -> RoleProcess:
        """Run ``command`` inside this host; it is stopped when the test ends."""
        proc = RoleProcess(["ip", "netns", "exec", self.namespace, *command], env=env)
        self.processes.append(proc)
        return proc


class Network:
    """Hosts on one bridge. ``create`` makes them; ``close`` removes everything."""

    def __init__(self) -> None:
        self.suffix = secrets.token_hex(3)
        self.switch = f"persia-{self.suffix}-sw"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []

    def create(self, names: tuple[str, ...] | list[str]) -> None:
        """The switch (a bridge in a namespace of its own), then one host per name."""
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for name in names:
            self.add_host(name)

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        index = len(self.hosts)
        host = Host(name, f"persia-{self.suffix}-{name}", f"{SUBNET}.{index + 1}",
                    f"port-{name}")
        self._add_namespace(host.namespace)
        _ip("-n", host.namespace, "link", "add", HOST_IFACE, "type", "veth",
            "peer", "name", host.switch_port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", host.switch_port, "master", "br0")
        _ip("-n", self.switch, "link", "set", host.switch_port, "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.ip}/24", "dev", HOST_IFACE)
        _ip("-n", host.namespace, "link", "set", HOST_IFACE, "up")
        self.hosts[name] = host
        return host

    def set_link(self, host: Host, up: bool) -> None:
        """Take a host's link to the bridge down or up (its cable pulled or put back)."""
        _ip("-n", self.switch, "link", "set", host.switch_port, "up" if up else "down")

    def set_partition(self, host: Host, cut: bool) -> None:
        """Cut ``host`` off from every other host, or join it again, with every link up:
        each side's neighbour entry for the other names an address no interface has, so
        their frames are silently dropped (no carrier lost, no reset, no ICMP), as behind
        a switch that stopped forwarding."""
        for other in self.hosts.values():
            if other is host:
                continue
            for here, there in ((host, other), (other, host)):
                if cut:
                    _ip("-n", here.namespace, "neigh", "replace", there.ip, "lladdr",
                        NOWHERE_MAC, "dev", HOST_IFACE, "nud", "permanent")
                else:
                    _ip("-n", here.namespace, "neigh", "del", there.ip, "dev", HOST_IFACE)

    def close(self) -> None:
        """Stop every host's processes, then delete the namespaces (and so their links)."""
        try:
            stop_all([proc for host in self.hosts.values() for proc in host.processes])
        finally:
            for name in reversed(self._namespaces):
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            self._namespaces.clear()


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they may be."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulated hosts need root (network namespaces)"
    if shutil.which("ip") is None:
        return "emulated hosts need the `ip` command (iproute2)"
    return None
