"""The four kinds of role, named once: the ``persia-launcher`` subcommand that runs one,
the short name of its processes and objects (``local``'s ``ps-0``, Kubernetes'
``<job>-ps``), and the words messages use."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DATA_LOADER", "EMBEDDING_WORKER", "NN_WORKER", "PARAMETER_SERVER", "ROLE_KINDS",
           "RoleKind", "kind_titled"]


@dataclass(frozen=True)
class RoleKind:
    command: str
    """The ``persia-launcher`` subcommand."""
    short: str
    """Prefix of its processes' and objects' names."""
    title: str
    """In messages (and ``benchmarks.role_processes.role_pid``)."""
    runs_script: bool
    """Whether its process starts the user's script (and torchrun) below it."""


PARAMETER_SERVER = RoleKind("embedding-parameter-server", "ps", "parameter server", False)
EMBEDDING_WORKER = RoleKind("embedding-worker", "embedding-worker", "embedding worker", False)
DATA_LOADER = RoleKind("data-loader", "data-loader", "data loader", True)
NN_WORKER = RoleKind("nn-worker", "nn-worker", "NN worker", True)
ROLE_KINDS = (PARAMETER_SERVER, EMBEDDING_WORKER, DATA_LOADER, NN_WORKER)


def kind_titled(title: str) -> RoleKind:
    """The kind whose :attr:`RoleKind.title` is ``title``; ValueError naming the titles."""
    for kind in ROLE_KINDS:
        if kind.title == title:
            return kind
    raise ValueError(f"kind {title!r} is not one of {[k.title for k in ROLE_KINDS]}")
