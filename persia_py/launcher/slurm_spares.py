"""Spare nodes of a Slurm job (``persia-launcher slurm --spare-nodes N``): where a parameter
server goes when its node is lost.

The batch script asks for ``--ps-nodes + --spare-nodes`` nodes in the parameter servers'
component and ``--no-kill``: a node that fails leaves the job's allocation, and the job
goes on without it. The first ``N`` nodes of the component are the spares (the first
also runs the job's supervisor, so a lost parameter-server node never takes the
supervisor with it); the parameter servers run on the others.

When a parameter server's step ends (``srun`` ends, code 0, once Slurm has marked the
node DOWN) or cannot start again, the supervisor asks Slurm about its node
(:func:`node_lost`): DOWN, drained, failed, not responding, or no longer in the job's
allocation. If it is lost, the server is started on the next free spare, on the same
port, as its restart (its checkpoint and its update log, which lies in the run folder on
the shared file system), and the job's address book gets its new address
(persia_py/wire/address_book.py): every client of that replica redials there once a call
finds it gone. Without a free spare it is started where it was, which fails, and the job
stops after the replica's restarts (``--max-restarts``).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable

from persia_py.launcher.job_model import Layout
from persia_py.launcher.role_kinds import PARAMETER_SERVER, RoleKind
from persia_py.wire.address_book import AddressBook

__all__ = ["SpareNodes", "node_lost"]

_LOST_STATES = ("down", "drain", "drng", "fail", "inval")
"""``sinfo %t`` states of a node the job cannot use (a ``*`` suffix: not responding).
Not ``unk``: every node is UNKNOWN for a moment after slurmctld restarts."""


def _run(args: list[str]) -> str | None:
    """A Slurm client's output, or None when it fails (the controller unreachable)."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _allocated(job_id: str, component: int) -> list[str] | None:
    """The nodes component ``component`` of job ``job_id`` holds now (None: unknown)."""
    text = _run(["scontrol", "show", "job", "--oneliner", job_id])
    if text is None:
        return None
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if fields.get("HetJobOffset", "0") == str(component) and "NodeList" in fields:
            expanded = _run(["scontrol", "show", "hostnames", fields["NodeList"]])
            return None if expanded is None else expanded.split()
    return None


def node_lost(node: str, job_id: str | None, component: int = 0) -> str | None:
    """Why ``node`` is lost to the job (its state, or that it left the allocation), or
    None while it is usable or Slurm cannot say."""
    text = _run(["sinfo", "--noheader", f"--nodes={node}", "--format=%t"])
    state = text.split()[0] if text and text.split() else ""
    if state.endswith("*") or state.rstrip("~#!%$@^-*").startswith(_LOST_STATES):
        return f"node {node} is {state}"
    if job_id is not None:
        nodes = _allocated(job_id, component)
        if nodes is not None and node not in nodes:
            return f"node {node} left the job's allocation"
    return None


class SpareNodes:
    """The spares of one allocation, and the moves of parameter servers onto them:
    ``Layout.lost`` and ``Layout.relocate`` of a Slurm job with spares."""

    def __init__(self, layout: Layout, spares: list[str], book: AddressBook,
                 job_id: str | None, log: Callable[[str], None]) -> None:
        self.layout = layout
        """The job's layout; its ``hosts`` change as servers move."""
        self.free = list(spares)
        self.book = book
        self.job_id = job_id
        self.log = log

    def lost(self, kind: RoleKind, index: int) -> bool:
        return node_lost(self.layout.hosts[kind][index], self.job_id) is not None

    def relocate(self, kind: RoleKind, index: int) -> None:
        """Before a restart of replica ``index`` of ``kind``: a parameter server whose
        node is lost moves to a free spare, and the address book says so."""
        node = self.layout.hosts[kind][index]
        why = node_lost(node, self.job_id) if kind is PARAMETER_SERVER else None
        if why is None:
            return
        if not self.free:
            self.log(f"{kind.short}-{index}: {why} and no spare node is left; starting it "
                     "there again")
            return
        self.layout.hosts[kind][index] = spare = self.free.pop(0)
        version = self.book.publish(self.layout.book())
        self.log(f"{kind.short}-{index}: {why}; starting it on spare node {spare} "
                 f"(address book {self.book.path} version {version}: its clients redial "
                 f"{self.layout.addresses(kind)[index]}; {len(self.free)} spare nodes left)")
