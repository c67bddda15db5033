"""A real Slurm cluster on emulated hosts, for tests: Debian's ``slurm-wlm`` (22.05) and
``munge``, ``slurmctld`` on host ``ctl`` (10.77.0.1) and one ``slurmd`` on each of
``node1``-``node3`` (10.77.0.2-4), every host a network namespace as :mod:`netns` makes them.

What it builds, in a folder of the test run:

- one ``munged`` (the machine's own network namespace: it serves a Unix socket, which every
  namespace reaches) with a fresh key and a socket of its own, named in ``AuthInfo``, so it
  never touches the machine's ``/run/munge``;
- a private ``slurm.conf`` (clients find it through ``SLURM_CONF``): partitions ``all``
  (the default, every node), ``highmem`` (node1) and ``gpu`` (node2, node3; a name only),
  each node 4 CPUs and 1 GiB whatever the machine has (``config_overrides``) and every
  partition ``OverSubscribe=FORCE:4``, so several jobs share a node; ``JobRequeue=1``,
  ``KillWait`` Slurm's default 30 s (:data:`KILL_WAIT_S`),
  ``ReturnToService=2`` and timeouts of seconds: a lost node is DOWN about 16 s after it
  stopped answering (:data:`MESSAGE_TIMEOUT_S`), and a requeued job starts again 11 s
  after its requeue at the earliest (:data:`CRED_EXPIRE_S`);
- each daemon in its host's namespace and in a UTS and mount namespace of its own: its
  host name is the node's name and ``/etc/hosts`` names every host, for the daemon and every
  job process it starts (a job on node2 reaches ``node3`` by name).

Limits: no cgroups (``proctrack/linuxproc``, ``task/none``: nothing confines a job's CPU or
memory, and a task that leaves its process tree escapes ``scancel``), no GPUs (``gpu`` is a
partition's name), no accounting database (``sacct`` has nothing; ``jobcomp/filetxt``
records each finished job), all jobs run as root, and every "host" shares this machine's
cores, memory and file system.

A test takes the module-scoped :class:`SlurmCluster` through conftest's ``slurm_cluster``
fixture; each test gets it healthy (every node idle, no job left).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from child_processes import RoleProcess, stop_all
from netns import Host, Network

T = TypeVar("T")

CONTROLLER = "ctl"
NODES = ("node1", "node2", "node3")
PARTITIONS = {"all": NODES, "highmem": ("node1",), "gpu": ("node2", "node3")}
"""Partition name -> its nodes; ``all`` is the default."""
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel")
"""What the cluster runs; ``scripts/install_slurm.sh`` installs them."""
SLURMD_TIMEOUT_S = 4
"""How long a node may not answer before slurmctld marks it DOWN (it pings every third of
that); ``SlurmdTimeout`` in slurm.conf."""
MESSAGE_TIMEOUT_S = 5
"""How long a Slurm RPC waits for its answer (``MessageTimeout``; Slurm's default 10 s).
A ping to a lost node fails only after it, and a node is DOWN after two failed pings: with
these two, a node killed or cut off mid-job was DOWN 16 s after (15.6-16.0 s, three runs
on this 2-core VM); at 3 and 3 it took 7 s (killed) and 11 s (cut off), at 6 and 5, 17-18
s. Lower values would make a loaded machine's slow answers count as failures."""
KILL_WAIT_S = 30
"""How long a job's processes have between Slurm's SIGTERM (a requeue, ``scancel``) and its
SIGKILL (``KillWait``; Slurm's default): the time a job has to stop in order, its NN
workers' last step and final checkpoint first (docs/deployment.md#slurm). A job that
stops in time costs nothing of it."""
CRED_EXPIRE_S = 10
"""A job step's credential lifetime (``AuthInfo=cred_expire``): a requeued job may start
again only that long (and a second) after its requeue (Slurm's default: 120 s)."""
START_TIMEOUT_S = 60.0


def unavailable_reason() -> str | None:
    """Why a cluster cannot be built on this machine, or None when it may be."""
    from netns import unavailable_reason as namespaces_unavailable

    reason = namespaces_unavailable()
    if reason is not None:
        return f"a Slurm cluster on emulated hosts: {reason}"
    missing = [name for name in COMMANDS if shutil.which(name) is None]
    if missing:
        told = os.environ.get("PERSIA_SLURM_UNAVAILABLE")
        return (f"Slurm is not installed ({', '.join(missing)} missing): "
                + (told or "scripts/install_slurm.sh installs slurm-wlm and munge "
                   "(root and apt needed)"))
    return None


def wait_until(what: str, check: Callable[[], T | None], timeout: float,
               describe: Callable[[], str] = lambda: "") -> T:
    """Poll ``check`` (every 0.2 s) until it returns something true, and return that;
    fails after ``timeout`` s, with ``describe()`` to say what was seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout:.0f} s\n{describe()}")
        time.sleep(0.2)


def on_host(host: Host, hosts_file: Path, command: list[str]) -> list[str]:
    """``command`` run on ``host``: in its network namespace, with its name as host name
    and ``hosts_file`` as ``/etc/hosts`` (a UTS and a private mount namespace of its own).

    ``nsenter --net`` rather than ``ip netns exec``: that one mounts a fresh ``/sys``, which
    hides ``/sys/fs/cgroup``, and slurmd 22.05 will not start without its cgroup plugin
    (``No filesystem mounted on /sys/fs/cgroup``), even though no cgroup is used here."""
    return ["nsenter", f"--net=/run/netns/{host.namespace}",
            "unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
            'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"',
            "slurm-host", host.name, str(hosts_file), *command]


class SlurmCluster:
    """slurmctld on ``ctl`` and one slurmd per node, with the helpers tests use: ``run`` a
    client, ``submit`` a batch script, read ``job``/``node`` states and wait on them,
    ``kill_node``/``restart_node``, ``cut_node``/``join_node``, ``requeue``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.network = Network()
        self._munge_dir = Path(tempfile.mkdtemp(prefix="persia-munge-"))
        self.munge_socket = self._munge_dir / "socket"
        self.conf = folder / "slurm.conf"
        self.hosts_file = folder / "hosts"
        self.controller: Host | None = None
        self.nodes: dict[str, Host] = {}
        self._munged: RoleProcess | None = None
        self._slurmctld: RoleProcess | None = None
        self._slurmd: dict[str, RoleProcess] = {}
        self._cut: set[str] = set()

    # -- start and stop --------------------------------------------------------------

    def boot(self) -> None:
        """Make the hosts, start munged, slurmctld and the slurmds; returns once every node
        is idle."""
        self.network.create([CONTROLLER, *NODES])
        self.controller = self.network.hosts[CONTROLLER]
        self.nodes = {name: self.network.hosts[name] for name in NODES}
        self._write_files()
        self._start_munged()
        self._slurmctld = self._start_daemon(CONTROLLER, ["slurmctld", "-D", "-i"])
        for name in NODES:
            self._start_slurmd(name)
        self.wait_for_nodes(NODES, {"idle"}, START_TIMEOUT_S)

    def _check_daemons(self) -> None:
        """Fails at once, with its output and the logs, if a daemon has exited."""
        daemons = {"munged": self._munged, "slurmctld": self._slurmctld,
                   **{f"slurmd on {name}": proc for name, proc in self._slurmd.items()}}
        for name, proc in daemons.items():
            if proc is not None and proc.process.poll() is not None:
                raise AssertionError(f"{name} exited {proc.process.returncode}:\n"
                                     f"{proc.output()}\n{self.logs()}")

    def close(self) -> None:
        """Stop every daemon and job process, delete the namespaces and munge's folder."""
        try:
            for host in self.network.hosts.values():
                _kill_namespace(host)
            if self._munged is not None:
                stop_all([self._munged])
        finally:
            try:
                self.network.close()
            finally:
                shutil.rmtree(self._munge_dir, ignore_errors=True)

    def _write_files(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.folder / sub).mkdir(exist_ok=True)
        self.hosts_file.write_text(
            "127.0.0.1 localhost\n"
            + "".join(f"{host.ip} {name}\n" for name, host in self.network.hosts.items()))
        self.conf.write_text(slurm_conf(self.folder, self.munge_socket, self.controller.ip,
                                        {name: host.ip for name, host in self.nodes.items()}))

    def _start_munged(self) -> None:
        # munged checks that every folder above its socket lets others in (0755 up to /):
        # pytest's tmp folders do not, so the socket has a folder of its own under /tmp
        self._munge_dir.chmod(0o755)
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._munged = RoleProcess([
            "munged", "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self._munge_dir / 'munged.pid'}",
            f"--seed-file={self.folder / 'munged.seed'}"])
        wait_until("munged's socket made", self.munge_socket.exists, 20, self._munged.output)

    def _start_slurmd(self, name: str) -> None:
        (self.folder / "spool" / name).mkdir(exist_ok=True)
        self._slurmd[name] = self._start_daemon(name, ["slurmd", "-D", "-N", name])

    def _start_daemon(self, host: str, command: list[str]) -> RoleProcess:
        """``command`` started on ``host``; stopped with the host's other processes."""
        proc = RoleProcess(self.command([*command, "-f", str(self.conf)], host), env=self.env())
        self.network.hosts[host].processes.append(proc)
        return proc

    # -- clients -----------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` naming the cluster's config."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def command(self, args: Iterable[str], host: str = CONTROLLER) -> list[str]:
        """``args`` run on ``host`` (its namespace, host name and /etc/hosts)."""
        return on_host(self.network.hosts[host], self.hosts_file, list(args))

    def run(self, *args: str, host: str = CONTROLLER, timeout: float = 30, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A client command (``sbatch``, ``srun``, ``scontrol``, ...) on ``host`` (the
        controller by default); with ``check``, fails on a non-zero exit, with its output."""
        done = subprocess.run(self.command(args, host), capture_output=True, text=True,
                              timeout=timeout, env=env or self.env(), cwd=self.folder)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}"
                                 f"{done.stderr}")
        return done

    def start(self, *args: str, host: str = CONTROLLER) -> RoleProcess:
        """A client command left running (``srun`` of a job's processes, ``sbatch --wait``)
        on ``host``; its output lines are collected, and it is stopped with the cluster if
        still running then."""
        proc = RoleProcess(self.command(args, host), env=self.env(), cwd=self.folder)
        self.network.hosts[host].processes.append(proc)
        return proc

    def submit(self, script: str, *options: str) -> int:
        """``sbatch --parsable [options]`` of ``script`` (its text, written to a file);
        returns the job id. The job's output goes to :meth:`output_path`, each run (a
        requeued job runs again) appended."""
        path = Path(tempfile.mkstemp(prefix="job-", suffix=".sh", dir=self.folder)[1])
        path.write_text(script)
        done = self.run("sbatch", "--parsable", "--open-mode=append",
                        f"--output={self.folder / 'job-%j.out'}", *options, str(path))
        return int(done.stdout.strip().split(";")[0])

    def output_path(self, job_id: int) -> Path:
        return self.folder / f"job-{job_id}.out"

    def output(self, job_id: int) -> str:
        """What the job's batch script and its steps printed so far."""
        path = self.output_path(job_id)
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for_output(self, job_id: int, pattern: str, timeout: float,
                        count: int = 1) -> list[re.Match]:
        """The first ``count`` matches of ``pattern`` (multi-line) in the job's output,
        once there are that many."""
        regex = re.compile(pattern, re.M)

        def found() -> list[re.Match] | None:
            matches = list(regex.finditer(self.output(job_id)))
            return matches[:count] if len(matches) >= count else None

        return wait_until(f"{count} x {pattern!r} in job {job_id}'s output", found, timeout,
                          lambda: f"{self.output(job_id)}\n{self.job(job_id)}\n{self.logs()}")

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``NodeList``, ``Restarts``, ...)."""
        done = self.run("scontrol", "show", "job", "--oneliner", str(job_id))
        return _fields(done.stdout)

    def wait_for_job(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        """The job once its ``JobState`` is one of ``states`` (``RUNNING``, ``COMPLETED``...)."""
        seen: list[dict[str, str]] = []

        def reached() -> dict[str, str] | None:
            seen[:] = [self.job(job_id)]
            return seen[0] if seen[0].get("JobState") in states else None

        return wait_until(f"job {job_id} {'/'.join(sorted(states))}", reached, timeout,
                          lambda: f"{seen}\n{self.logs()}")

    def node_states(self) -> dict[str, str]:
        """Node name -> its state, lower case (``idle``, ``mixed``, ``down*``, ...)."""
        done = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", "--partition=all")
        return dict(line.split() for line in done.stdout.splitlines() if line.strip())

    def wait_for_nodes(self, names: Iterable[str], states: set[str], timeout: float,
                       any_of: bool = False) -> dict[str, str]:
        """The nodes' states once every one of ``names`` (with ``any_of``: one of them) is
        in one of ``states`` (``idle``, ``mix``, ``alloc``, ``down*``: sinfo's short forms,
        ``*`` for not responding)."""
        names = list(names)
        seen: list[dict[str, str]] = [{}]
        enough = any if any_of else all

        def reached() -> dict[str, str] | None:
            self._check_daemons()
            try:
                seen[0] = self.node_states()
            except AssertionError as exc:  # the controller not up yet
                seen[0] = {"sinfo": str(exc)}
                return None
            return seen[0] if enough(seen[0].get(n) in states for n in names) else None

        return wait_until(f"nodes {names} {'/'.join(sorted(states))}", reached, timeout,
                          lambda: f"{seen[0]}\n{self.logs()}")

    def requeue(self, job_id: int) -> None:
        self.run("scontrol", "requeue", str(job_id))

    # -- faults ------------------------------------------------------------------------

    def kill_node(self, name: str) -> None:
        """The node is lost: its slurmd and every process on it (job steps, tasks) are
        killed with SIGKILL. slurmctld marks it DOWN about 16 s later (see
        :data:`MESSAGE_TIMEOUT_S`) and requeues its batch jobs."""
        _kill_namespace(self.nodes[name])
        proc = self._slurmd.pop(name, None)
        if proc is not None:
            proc.stop()

    def restart_node(self, name: str, timeout: float = START_TIMEOUT_S) -> None:
        """Start a killed node's slurmd again and wait until the node is idle (a node DOWN
        for not answering returns by itself: ``ReturnToService=2``)."""
        if name not in self._slurmd or self._slurmd[name].process.poll() is not None:
            self._start_slurmd(name)
        self.wait_for_nodes([name], {"idle"}, timeout)

    def cut_node(self, name: str) -> None:
        """Cut the node's network off from every other host (its processes keep running):
        slurmctld marks it DOWN as it would a killed one."""
        self.network.set_partition(self.nodes[name], cut=True)
        self._cut.add(name)

    def join_node(self, name: str) -> None:
        """Join a cut node again; it is back once it answers (``ReturnToService=2``)."""
        self.network.set_partition(self.nodes[name], cut=False)
        self._cut.discard(name)

    def make_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Every job cancelled, every node's network joined and slurmd running, every node
        idle: what a test finds when it takes the cluster."""
        self.run("scancel", "--full", "--quiet", "--user=root", check=False)
        for name in sorted(self._cut):
            self.join_node(name)
        for name in NODES:
            if name not in self._slurmd or self._slurmd[name].process.poll() is not None:
                self._start_slurmd(name)
        self.wait_for_nodes(NODES, {"idle"}, timeout)

    # -- diagnosis ---------------------------------------------------------------------

    def logs(self, lines: int = 30) -> str:
        """The last ``lines`` of every daemon's log."""
        out = []
        for path in sorted((self.folder / "log").glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)


def _kill_namespace(host: Host) -> None:
    """SIGKILL every process whose network namespace is ``host``'s."""
    done = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True,
                          text=True, timeout=30)
    for pid in done.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fields(text: str) -> dict[str, str]:
    """``Key=value Key2=value2 ...`` (scontrol's one-line output) as a dict."""
    return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", text))


def slurm_conf(folder: Path, munge_socket: Path, controller_ip: str,
               node_ips: dict[str, str]) -> str:
    """The cluster's slurm.conf: everything it writes under ``folder``."""
    log = folder / "log"
    nodes = "".join(
        f"NodeName={name} NodeAddr={ip} NodeHostname={name} CPUs=4 RealMemory=1024 "
        "State=UNKNOWN\n" for name, ip in node_ips.items())
    partitions = "".join(
        f"PartitionName={name} Nodes={','.join(members)} Default={'YES' if name == 'all' else 'NO'} "
        "OverSubscribe=FORCE:4 MaxTime=INFINITE State=UP\n"
        for name, members in PARTITIONS.items())
    return f"""\
# Written by tests/slurm_cluster.py for one test run.
ClusterName=persia-test
SlurmctldHost={CONTROLLER}({controller_ip})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={folder / 'state'}
SlurmdSpoolDir={folder / 'spool'}/%n
SlurmctldPidFile={folder / 'slurmctld.pid'}
SlurmdPidFile={folder / 'spool'}/slurmd-%n.pid
SlurmctldLogFile={log / 'slurmctld.log'}
SlurmdLogFile={log}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={log / 'jobcomp.txt'}
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
PropagateResourceLimits=NONE
ReturnToService=2
JobRequeue=1
SlurmdTimeout={SLURMD_TIMEOUT_S}
SlurmctldTimeout=10
MessageTimeout={MESSAGE_TIMEOUT_S}
TCPTimeout=1
KillWait={KILL_WAIT_S}
InactiveLimit=0
MinJobAge=300
BatchStartTimeout=10
UnkillableStepTimeout=10
{nodes}{partitions}"""
