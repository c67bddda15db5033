"""CPU seconds per role of a ``persia-launcher local`` job, over the benchmark's timed
window only (start-up and imports excluded), read from /proc.

The job's NN worker prints ``timing_started`` when its clock starts and
``samples_per_sec: …`` when it stops; :func:`run_job` snapshots every process below the
launcher at both lines and polls in between. A process that exits inside the window (a
restarted role, or a whole rank, torchrun and wrapper at the job's end) counts to its end,
once: when the nearest process still running above it has reaped it, what it and its
gone descendants ran after their last polls shows in that process's ``cutime``/``cstime``.

A job's scripts may print ``figures: NAME=VALUE ...`` lines (per-step latencies, counts of
their own); :attr:`JobResult.figures` holds them. With ``own_network`` the job runs in a
network namespace of its own (``unshare --net``, loopback only), and the bytes sent over its
loopback inside the window (every message between its processes but what they exchange
through shared memory, TCP/IP headers included) are :attr:`JobResult.network_bytes`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from benchmarks.role_processes import is_wrapper
from persia_py.launcher.processes import descendants

ROLES = ("parameter_server", "embedding_worker", "data_loader", "nn_worker", "launcher")
_TICK = os.sysconf("SC_CLK_TCK")
_POLL_SEC = 0.25
_HOLDER = ["unshare", "--net", "sh", "-c", "ip link set lo up && echo up && exec cat"]
"""A process in a network namespace of its own, loopback up, that holds it until its stdin
closes."""


def own_network_unavailable() -> str | None:
    """Why a job cannot run in a network namespace of its own here, or None."""
    missing = [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found"
    probe = subprocess.run(_HOLDER, input="", capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or probe.stdout != "up\n":
        return f"unshare --net failed: {probe.stderr.strip() or probe.returncode}"
    return None


class OwnNetwork:
    """A network namespace of its own, loopback only, for a job: :meth:`run_in` prefixes
    its command, :meth:`bytes_sent` reads what went over the loopback so far. Held by a
    process of its own until :meth:`close` (the count stays readable after the job)."""

    def __init__(self) -> None:
        self._holder = subprocess.Popen(_HOLDER, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        assert self._holder.stdout is not None
        if self._holder.stdout.readline() != "up\n":  # set up, or failed
            self.close()
            raise RuntimeError(f"no network namespace of its own: unshare --net exited "
                               f"{self._holder.returncode}")

    def run_in(self, command: list[str]) -> list[str]:
        return ["nsenter", f"--net=/proc/{self._holder.pid}/ns/net", "--", *command]

    def bytes_sent(self) -> int:
        with open(f"/proc/{self._holder.pid}/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == "lo":
                    return int(counters.split()[8])  # transmit bytes
        raise LookupError(f"no loopback in /proc/{self._holder.pid}/net/dev")

    def close(self) -> None:
        if self._holder.stdin is not None:
            self._holder.stdin.close()
        self._holder.wait(timeout=60)


def role_of(argv: list[str], *, train_script: str, loader_script: str) -> str:
    """Which role a process of the job is, from its command line."""
    wrapper = is_wrapper(argv)
    if "embedding-parameter-server" in argv:
        return "parameter_server"
    if "embedding-worker" in argv:
        return "embedding_worker"
    if not wrapper and any(a.endswith(loader_script) for a in argv):
        return "data_loader"
    if not wrapper and any(a.endswith(train_script) for a in argv):
        return "nn_worker"
    return "launcher"


def _cpu_ticks(pid: int) -> tuple[int, int, int]:
    """(utime + stime of every thread of the process, cutime + cstime: its reaped
    children's, parent pid)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]), int(fields[1])


@dataclass
class _Window:
    root: int
    train_script: str
    loader_script: str
    role: dict[int, str] = field(default_factory=dict)
    first: dict[int, int] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)
    reaped: dict[int, int] = field(default_factory=dict)
    """Each polled process's children's CPU (cutime + cstime) at its last poll."""
    parent: dict[int, int] = field(default_factory=dict)
    tail: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per role, what processes that exited ran after their last poll."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def poll(self, *, baseline: bool = False) -> None:
        seen: dict[int, tuple[int, int, int]] = {}
        for pid in [self.root, *descendants(self.root)]:
            try:
                # A child polled between fork and exec shows its parent's command
                # line: a "launcher" is named again until it has its own.
                if self.role.get(pid, "launcher") == "launcher":
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        argv = f.read().decode(errors="replace").split("\0")
                    self.role[pid] = role_of(argv, train_script=self.train_script,
                                             loader_script=self.loader_script)
                seen[pid] = _cpu_ticks(pid)
            except (OSError, ValueError):  # exited meanwhile
                continue
        with self.lock:
            self._count_exited(seen)
            for pid, (ticks, children, parent) in seen.items():
                if baseline or pid not in self.first:
                    # a process born inside the window counts from zero
                    self.first.setdefault(pid, ticks if baseline else 0)
                self.last[pid] = ticks
                self.reaped[pid] = children
                self.parent[pid] = parent

    def _count_exited(self, seen: dict[int, tuple[int, int, int]]) -> None:
        """Processes polled before and gone now. The nearest one still running above a
        gone one reaped it (or the gone one's gone parent did): its children's CPU grew
        by all they ran, the gone descendants' included (a rank, its torchrun and their
        wrapper can end between two polls). What that is beyond their last polls goes to
        the role of the topmost gone process."""
        gone = [pid for pid in self.reaped if pid not in seen]
        trees: dict[int, list[int]] = defaultdict(list)  # topmost gone -> its gone subtree
        for pid in gone:
            top = pid
            while self.parent.get(top) in self.reaped and self.parent[top] not in seen:
                top = self.parent[top]
            trees[top].append(pid)
        by_parent: dict[int, list[int]] = defaultdict(list)
        for top in trees:
            if self.parent.get(top) in seen:
                by_parent[self.parent[top]].append(top)
        for parent, tops in by_parent.items():
            grown = seen[parent][1] - self.reaped.get(parent, seen[parent][1])
            known = sum(self.last[p] + self.reaped[p] for top in tops for p in trees[top])
            if grown > known:  # several trees at once: the first one's role takes it
                self.tail[self.role[tops[0]]] += grown - known
        for pid in gone:
            del self.reaped[pid]

    def seconds(self) -> dict[str, float]:
        per_role: dict[str, float] = defaultdict(float)
        with self.lock:
            for pid, ticks in self.last.items():
                per_role[self.role[pid]] += (ticks - self.first.get(pid, 0)) / _TICK
            for role, ticks in self.tail.items():
                per_role[role] += ticks / _TICK
        return {role: per_role.get(role, 0.0) for role in ROLES}


@dataclass
class JobResult:
    samples_per_sec: float
    samples: int
    cpu_sec: dict[str, float]
    figures: dict[str, float] = field(default_factory=dict)
    """What the job's scripts printed on ``figures: NAME=VALUE ...`` lines."""
    network_bytes: int | None = None
    """Bytes over the job's own loopback inside the window (``run_job(own_network=True)``)."""

    def cpu_per_1000(self) -> dict[str, float]:
        """Core-seconds per 1,000 trained samples, per role and ``all``."""
        per = {role: 1000 * sec / self.samples for role, sec in self.cpu_sec.items()}
        per["all"] = sum(per.values())
        return per


def _figures(line: str) -> dict[str, float]:
    """The ``NAME=VALUE`` pairs after ``figures:`` on ``line``."""
    return {name: float(value) for name, value in
            re.findall(r"(\w+)=([-+0-9.eE]+)", line.partition("figures:")[2])}


def run_job(command: list[str], *, cwd: str, env: dict[str, str] | None, what: str,
            train_script: str, loader_script: str, own_network: bool = False) -> JobResult:
    """Run a ``local`` job and measure its timed window (in a network namespace of its
    own if ``own_network``: see :func:`own_network_unavailable`)."""
    network = OwnNetwork() if own_network else None
    try:
        return _run_job(network.run_in(command) if network else command, cwd=cwd, env=env,
                        what=what, train_script=train_script, loader_script=loader_script,
                        network=network)
    finally:
        if network:
            network.close()


def _run_job(command: list[str], *, cwd: str, env: dict[str, str] | None, what: str,
             train_script: str, loader_script: str, network: OwnNetwork | None) -> JobResult:
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    window = _Window(proc.pid, train_script, loader_script)
    stop = threading.Event()

    def poll_until_stopped() -> None:
        while not stop.wait(_POLL_SEC):
            window.poll()

    poller = threading.Thread(target=poll_until_stopped, daemon=True)
    tail: list[str] = []
    result = None
    figures: dict[str, float] = {}
    sent = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-200:]
        if "figures:" in line:
            figures.update(_figures(line))
        if "timing_started" in line and not poller.is_alive():
            window.poll(baseline=True)
            sent = network.bytes_sent() if network else 0
            poller.start()
        match = re.search(r"samples_per_sec: ([0-9.]+) samples: ([0-9]+)", line)
        if match and result is None and poller.is_alive():
            window.poll()
            stop.set()
            result = JobResult(float(match.group(1)), int(match.group(2)), window.seconds(),
                               figures, network.bytes_sent() - sent if network else None)
    stop.set()
    code = proc.wait()
    if code != 0 or result is None:
        raise RuntimeError(f"{what} failed ({code}):\n{''.join(tail)[-6000:]}")
    return result
