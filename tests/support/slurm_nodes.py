"""A real four-node Slurm cluster on this one machine (Debian slurm-wlm + munge), for tests that need
several hosts: srun and sbatch across nodes, MPI ranks on different hostnames, a /tmp that is not
shared.

Each node (node1..node4) is a network + UTS + mount namespace: a veth on a bridge the fixture makes
(a free private /24, the host at .1, the nodes at .11-.14; no default route, no NAT, ip_forward is
left alone), its own hostname, an /etc/hosts naming the nodes and the host, a private tmpfs /tmp and
its own slurmd. Nodes are entered with `nsenter --net=/run/netns/NS unshare --uts --mount`, never
`ip netns exec` (it remounts /sys, and slurmd 22.05 dies without /sys/fs/cgroup). One shared
directory (`shared`, a temp dir) is seen at the same path on every node, as are the checkout, the
venv and the session's DeepSpeed op builds (bound into the private /tmp when they live under /tmp, as
a shared home's ~/.cache would be: else every node builds the ops again, four builds at once on two
cores); /dev/shm stays shared. One private munged (its own key and socket), one slurmctld on the host
side at the bridge address, 2 fake GPUs (mknod character devices) and 4 CPUs per node.

Every daemon is a Popen child, stopped by its pid and waited for; namespaces, bridge, veths, mounts
and temp dirs go when the context ends, a failed test included, and so do the /dev/shm segments
MPICH leaves when a step is killed (only those this cluster made). A machine where the binaries, root,
the namespaces or the bridge are missing skips these tests with the reason, unless CI is set: CI
must run them. Nothing is faked.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support.commands import EXTENSIONS_DIR, REPO
from support.node_network import RUN_NETNS, Unavailable, free_subnet, is_mounted, make_network, remove_network
from support.slurm_cluster import CONF_COMMON, SlurmClient, _stop, free_ports

__all__ = ["SlurmNodes", "slurm_nodes", "start_nodes"]

BINARIES = (
    "slurmctld",
    "slurmd",
    "munged",
    "munge",
    "unmunge",
    "scontrol",
    "sinfo",
    "sbatch",
    "squeue",
    "srun",
    "ip",
    "nsenter",
    "unshare",
    "mount",
    "mknod",
)
NODES = 4
GPUS_PER_NODE, CPUS_PER_NODE = 2, 4
SHARED_MEMORY = Path("/dev/shm")
VENV = Path(sys.prefix)  # the venv this session runs in (sys.executable's)

# Run inside a fresh UTS + mount namespace (already in the node's network namespace): name the node,
# give it the shared /etc/hosts, a private tmpfs /tmp with the shared paths bound in at their own
# paths (staged, then moved onto /tmp), then exec the command (slurmd).
NODE_INIT = r"""set -eu
node=$1 hosts=$2 stage=$3
shift 3
hostname "$node"
mount --bind "$hosts" /etc/hosts
mount -t tmpfs -o mode=1777 "tmp-$node" "$stage"
while [ "$1" != -- ]; do
    mkdir -p "$stage/${1#/tmp/}"
    mount --bind "$1" "$stage/${1#/tmp/}"
    shift
done
shift
mount --move "$stage" /tmp
exec "$@"
"""


@dataclass
class SlurmNodes(SlurmClient):
    """The running cluster. `env` (with SLURM_CONF) is what host-side Slurm clients need; `shared` is
    the directory every node sees at the same path (jobs, outputs, caches)."""

    nodes: list[str]
    addresses: dict[str, str]  # node -> its address on the bridge
    host_address: str
    partition: str
    shared: Path
    conf: Path
    env: dict[str, str]
    netns: dict[str, str]  # node -> the name under /run/netns
    bridge: str
    gpus_per_node: int = GPUS_PER_NODE
    cpus_per_node: int = CPUS_PER_NODE
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    jobs_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.jobs_dir = self.shared / "jobs"
        self.jobs_dir.mkdir(exist_ok=True)

    def node_exec(
        self, node: str, args: Sequence[str], check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside `node`'s network, UTS and mount namespaces (those of its slurmd), from
        the shared jobs dir; text output."""
        pid = self.daemons[f"slurmd-{node}"].pid
        command = [
            "nsenter",
            "-t",
            str(pid),
            "--net",
            "--uts",
            "--mount",
            f"--wd={self.jobs_dir}",
            "--",
            *map(str, args),
        ]
        proc = subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{node}: {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
            )
        return proc

    def node_pids(self, node: str, marker: str) -> list[int]:
        """The pids of processes running on `node` (in its network namespace, slurmd's own excluded)
        whose command line contains `marker`: what `pkill` on that node alone would match."""
        slurmd = self.daemons[f"slurmd-{node}"].pid
        netns = os.readlink(f"/proc/{slurmd}/ns/net")
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == slurmd:
                continue
            try:
                if os.readlink(entry / "ns" / "net") == netns and marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
        return pids

    def node_tmp(self, node: str) -> Path:
        """The host's path to `node`'s private /tmp (through its slurmd's root)."""
        return Path(f"/proc/{self.daemons[f'slurmd-{node}'].pid}/root/tmp")

    @property
    def root(self) -> Path:  # type: ignore[override]  (where the logs are: the shared directory)
        return self.shared

    def node_names(self) -> list[str]:
        return list(self.nodes)

    def log_files(self) -> list[str]:
        return ["munge/munged.log", "logs/slurmctld.log", *(f"logs/slurmd-{node}.log" for node in self.nodes)]


def _missing_prerequisites() -> list[str]:
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if os.geteuid() != 0:
        missing.append("root (namespaces, the bridge, slurmd and mknod need it)")
    return missing


def _mpich_segments() -> set[str]:
    return {path.name for path in SHARED_MEMORY.glob("mpich_shm_*")}


def _remove_node_segments(before: set[str]) -> None:
    """MPICH's /dev/shm segments that a killed step left (`mpich_shm_<step hash>_<node index>`; a
    rank that ends normally removes its own). /dev/shm is shared with the host and its other tests:
    only new ones with a node index past 0 are this cluster's (a one-node run makes `_0` only), and
    those go with their `_0`."""
    new = _mpich_segments() - before
    for name in {name.rsplit("_", 1)[0] for name in new if not name.endswith("_0")}:
        for index in range(NODES):
            (SHARED_MEMORY / f"{name}_{index}").unlink(missing_ok=True)


def _munge_answers(socket_path: Path) -> bool:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        cred = subprocess.run(["munge", "-n", "-S", str(socket_path)], capture_output=True, timeout=5, check=True)
        return (
            subprocess.run(
                ["unmunge", "-S", str(socket_path)], input=cred.stdout, capture_output=True, timeout=5
            ).returncode
            == 0
        )
    return False


def _start_munged(root: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """A private munged as user munge: its own key, socket, pid, seed and log in root/munge."""
    home = root / "munge"
    home.mkdir()
    home.chmod(0o755)  # munged wants its socket's directory open to all; the key stays 0400
    key = home / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for path in (home, key):
        shutil.chown(path, "munge", "munge")
    socket_path = home / "munge.socket"
    command = [
        "munged",
        "--foreground",
        "-S",
        str(socket_path),
        f"--key-file={key}",
        f"--pid-file={home}/munged.pid",
        f"--seed-file={home}/munged.seed",
        f"--log-file={home}/munged.log",
    ]
    with open(root / "logs" / "munged.out", "wb") as out:
        proc = subprocess.Popen(command, user="munge", group="munge", stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while not _munge_answers(socket_path):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            text = (root / "logs" / "munged.out").read_text(errors="replace")
            pytest.fail(f"private munged did not start (exit {proc.returncode}):\n{text}")
        time.sleep(0.05)
    return proc, socket_path


def _write_config(root: Path, subnet: ipaddress.IPv4Network, munge_socket: Path, partition: str) -> Path:
    """slurm.conf, gres.conf, the nodes' /etc/hosts, fake GPU devices, state and spool dirs."""
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    for name in ("state", "spool", "dev", "stage"):
        (root / name).mkdir()
    for index in range(GPUS_PER_NODE):
        subprocess.run(["mknod", str(root / "dev" / f"nvidia{index}"), "c", "1", "3"], check=True, capture_output=True)
    hosts = ["127.0.0.1 localhost", f"{subnet[1]} {host}"]
    hosts += [f"{subnet[10 + i]} node{i}" for i in range(1, NODES + 1)]
    (root / "hosts").write_text("\n".join(hosts) + "\n")
    ctld_port, slurmd_port = free_ports(2)
    first, last = 11, 10 + NODES
    net = str(subnet.network_address).rsplit(".", 1)[0]
    # Job ids start anywhere (see tests/support/slurm_cluster.py: MPICH's /dev/shm segments are named after
    # the job and step, and /dev/shm is shared by every node and every cluster on this machine).
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=stk-nodes
FirstJobId={random.randrange(1000, 60_000_000)}
SlurmctldHost={host}({subnet[1]})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/logs/slurmctld.log
SlurmdLogFile={root}/logs/slurmd-%n.log
{CONF_COMMON}NodeName=node[1-{NODES}] NodeAddr={net}.[{first}-{last}] CPUs={CPUS_PER_NODE} \
Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN
PartitionName={partition} Nodes=node[1-{NODES}] Default=YES MaxTime=INFINITE State=UP
"""
    )
    (root / "gres.conf").write_text(
        f"AutoDetect=off\nNodeName=node[1-{NODES}] Name=gpu File={root}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n"
    )
    for i in range(1, NODES + 1):
        (root / "spool" / f"node{i}").mkdir()
        (root / "stage" / f"node{i}").mkdir()
    return conf


def _shared_paths(root: Path) -> list[str]:
    """What every node must see at the same path and that a private /tmp would hide."""
    EXTENSIONS_DIR.mkdir(parents=True, exist_ok=True)  # to bind it, before any build made it
    paths = {root, REPO, VENV, Path(sys.executable).resolve().parent, EXTENSIONS_DIR}
    tmp = Path("/tmp")
    return sorted(str(p) for p in paths if tmp in p.resolve().parents)


def _start_slurmd(cluster: SlurmNodes, node: str, binds: list[str]) -> None:
    root = cluster.shared
    command = [
        "nsenter",
        f"--net=/run/netns/{cluster.netns[node]}",
        "unshare",
        "--uts",
        "--mount",
        "--propagation",
        "private",
        "/bin/sh",
        "-c",
        NODE_INIT,
        "node-init",
        node,
        str(root / "hosts"),
        str(root / "stage" / node),
        *binds,
        "--",
        "slurmd",
        "-D",
        "-f",
        str(cluster.conf),
    ]
    with open(root / "logs" / f"slurmd-{node}.out", "wb") as out:
        cluster.daemons[f"slurmd-{node}"] = subprocess.Popen(
            command, env=cluster.env, stdout=out, stderr=subprocess.STDOUT, cwd="/"
        )


def _end_jobs(cluster: SlurmNodes) -> None:
    """Cancel what is still queued or running, so no job step outlives its slurmd."""
    if cluster.daemons.get("slurmctld") is None or cluster.daemons["slurmctld"].poll() is not None:
        return
    with contextlib.suppress(subprocess.SubprocessError, AssertionError):
        cluster.run(["scancel", "--user=root"], check=False, timeout=10)
        deadline = time.monotonic() + 10
        while cluster.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10).stdout.strip():
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)


@contextlib.contextmanager
def start_nodes(partition: str = "debug") -> Iterator[SlurmNodes]:
    """Make the network, start munged, slurmctld and a slurmd per node; undo all of it on exit."""
    missing = _missing_prerequisites()
    if missing:
        _unavailable(f"missing: {', '.join(missing)} (apt-get install slurm-wlm munge iproute2 util-linux)")
    tag = os.urandom(3).hex()
    nodes = [f"node{i}" for i in range(1, NODES + 1)]
    netns = {node: f"stk-{tag}-{node}" for node in nodes}
    bridge = f"stkbr{tag}"
    root = Path(tempfile.mkdtemp(prefix="stk-nodes-"))
    root.chmod(0o755)  # munged runs as user munge and must reach root/munge
    (root / "logs").mkdir()
    segments = _mpich_segments()
    run_netns_before = (RUN_NETNS.exists(), is_mounted(RUN_NETNS))
    cluster: SlurmNodes | None = None
    munged: subprocess.Popen[bytes] | None = None
    try:
        try:
            subnet = free_subnet()
            make_network(tag, subnet, netns, bridge)
        except Unavailable as error:
            _unavailable(f"cannot make the nodes' namespaces and bridge: {error}")
        munged, munge_socket = _start_munged(root)
        conf = _write_config(root, subnet, munge_socket, partition)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
        env["SLURM_CONF"] = str(conf)
        addresses = {node: str(subnet[10 + i]) for i, node in enumerate(nodes, start=1)}
        cluster = SlurmNodes(nodes, addresses, str(subnet[1]), partition, root, conf, env, netns, bridge)
        with open(root / "logs" / "slurmctld.out", "wb") as out:
            cluster.daemons["slurmctld"] = subprocess.Popen(
                ["slurmctld", "-D", "-c", "-f", str(conf)], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        binds = _shared_paths(root)
        for node in nodes:
            _start_slurmd(cluster, node, binds)
        cluster.wait_idle()
        yield cluster
    finally:
        if cluster is not None:
            _end_jobs(cluster)
            for proc in reversed(cluster.daemons.values()):
                _stop(proc)
        if munged is not None:
            _stop(munged)
        left = remove_network(netns, bridge, run_netns_before)
        _remove_node_segments(segments)
        shutil.rmtree(root, ignore_errors=True)
        if left:
            pytest.fail(f"the Slurm nodes left behind: {', '.join(left)}")


def _unavailable(reason: str) -> None:
    message = f"four-node Slurm unavailable: {reason}"
    if os.environ.get("CI"):
        pytest.fail(message + "; CI is set, so this must not be skipped")
    pytest.skip(message)


@pytest.fixture(scope="session")
def slurm_nodes() -> Iterator[SlurmNodes]:
    """A four-node Slurm cluster for the session (see the module docstring)."""
    with start_nodes() as cluster:
        yield cluster
