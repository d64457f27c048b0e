"""The four-node cluster's network: a bridge on a free private /24 with the host at .1, a network namespace
per node with its eth0 on the bridge, and their removal (with the /run/netns mount `ip netns add` makes)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import subprocess
from pathlib import Path

RUN_NETNS = Path("/run/netns")


class Unavailable(Exception):
    """This machine cannot run the cluster (no namespaces, no bridge, no binaries): skip, or fail in CI."""


def _ip(*args: str, stdin: str | None = None) -> None:
    proc = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise Unavailable(f"ip {' '.join(args)} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}")


def free_subnet() -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that overlaps no address or route this machine has."""
    used: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for command in (["ip", "-j", "-4", "route", "show", "table", "all"], ["ip", "-j", "-4", "addr"]):
        out = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout or "[]"
        for entry in json.loads(out):
            prefixes = [entry.get("dst", "")] + [f"{a['local']}/{a['prefixlen']}" for a in entry.get("addr_info", [])]
            for prefix in prefixes:
                with contextlib.suppress(ValueError):
                    used.append(ipaddress.ip_network(prefix if prefix != "default" else "0.0.0.0/32", strict=False))
    for _ in range(100):
        subnet = ipaddress.IPv4Network(f"10.{random.randrange(100, 255)}.{random.randrange(256)}.0/24")
        if not any(subnet.overlaps(other) for other in used if other.prefixlen > 0):
            return subnet
    raise Unavailable("no free 10.x.y.0/24 for the bridge")


def make_network(tag: str, subnet: ipaddress.IPv4Network, netns: dict[str, str], bridge: str) -> list[str]:
    """The bridge with the host at .1, a namespace per node with eth0 at .11, .12 ...; returns the
    host-side veth names. Raises Unavailable (the caller removes whatever was made)."""
    host = f"{subnet[1]}/{subnet.prefixlen}"
    veths = [f"stk{tag}v{i}" for i in range(1, len(netns) + 1)]
    lines = [f"link add {bridge} type bridge", f"addr add {host} dev {bridge}", f"link set {bridge} up"]
    for veth, ns in zip(veths, netns.values(), strict=True):
        lines += [
            f"netns add {ns}",
            f"link add {veth} type veth peer name eth0 netns {ns}",
            f"link set {veth} master {bridge}",
            f"link set {veth} up",
        ]
    _ip("-batch", "-", stdin="\n".join(lines) + "\n")
    for i, ns in enumerate(netns.values(), start=11):
        batch = f"link set lo up\naddr add {subnet[i]}/{subnet.prefixlen} dev eth0\nlink set eth0 up\n"
        _ip("-n", ns, "-batch", "-", stdin=batch)
    return veths


def is_mounted(path: Path) -> bool:
    """Whether `path` is a mount point (mountinfo: a bind mount of a directory onto itself, as
    `ip netns add` makes of /run/netns, has the device of its parent, so os.path.ismount misses it)."""
    with open("/proc/self/mountinfo") as mounts:
        return any(line.split()[4] == str(path) for line in mounts)


def remove_network(netns: dict[str, str], bridge: str, run_netns_before: tuple[bool, bool]) -> list[str]:
    """Delete the namespaces (their veths go with them) and the bridge, and the /run/netns mount and
    directory that `ip netns add` made if they were not there before and no namespace is left in
    them; what could not be removed."""
    existed, mounted = run_netns_before
    left = []
    for ns in netns.values():
        if (RUN_NETNS / ns).exists():
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                # A process of ours still in the node (a job step that outlived slurmd): end it.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            if subprocess.run(["ip", "netns", "del", ns], capture_output=True).returncode != 0:
                left.append(f"netns {ns}")
    if (
        Path("/sys/class/net", bridge).exists()
        and subprocess.run(["ip", "link", "del", bridge], capture_output=True).returncode
    ):
        left.append(f"bridge {bridge}")
    if not mounted and is_mounted(RUN_NETNS) and not any(RUN_NETNS.iterdir()):
        subprocess.run(["umount", str(RUN_NETNS)], capture_output=True)
    if not existed and not is_mounted(RUN_NETNS):
        with contextlib.suppress(OSError):
            RUN_NETNS.rmdir()
    return left
