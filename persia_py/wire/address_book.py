"""The job's address book: where each server replica is reached now.

The supervisor (``persia-launcher local``, or ``slurm``'s on the allocation's first node)
owns it: one JSON file in the job's run folder, ``{"version": N, "roles": {kind:
[address of replica 0, 1, ...]}}``, written whole beside its name and renamed over it
(readers see the old book or the new one, never half of one), mode 0600 (the run folder
is the job user's alone), its version one past the book it replaces. It changes when a
replica moves: a parameter server whose Slurm node was lost is started on a spare node
(persia_py/launcher/slurm_run.py). Under ``local`` it never changes.

Every client of a parameter server reads its replica's address in it
(:class:`BookEntry`) only when a call to the replica fails as a call to a server that is
gone does (UNAVAILABLE, or no answer by the deadline): the calls of a job whose servers
stay where they are never touch it (:func:`persia_py.wire.rpc.call`'s ``redial``). A
supervisor started again (a requeued Slurm job) writes the book of its own layout, one
version past the file it finds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from persia_py.env import ENV_ADDRESS_BOOK
from persia_py.ops.private_files import write_private_file

__all__ = ["ADDRESS_BOOK_FILE", "ENV_ADDRESS_BOOK", "AddressBook", "BookEntry", "BookError",
           "PARAMETER_SERVERS", "book_at", "servers_now"]

ADDRESS_BOOK_FILE = "addresses.json"
"""The book's name in the run folder."""
PARAMETER_SERVERS = "ps"
"""The parameter servers' kind in the book (the launcher's ``RoleKind.short``)."""


class BookError(ValueError):
    """The book cannot be read as one (its path and what is wrong in the message)."""


@dataclass(frozen=True)
class AddressBook:
    """The book at ``path``: read by any role of the job, written by its supervisor."""

    path: str

    def read(self) -> tuple[int, dict[str, list[str]]]:
        """``(version, kind -> addresses in replica order)``; :class:`BookError` naming
        the file when it is missing or not a book."""
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise BookError(f"address book {self.path}: missing (the supervisor writes it "
                            f"before any role starts; ${ENV_ADDRESS_BOOK} names it)") from None
        except (OSError, ValueError) as exc:
            raise BookError(f"address book {self.path}: cannot be read ({exc})") from None
        version, roles = (data.get("version"), data.get("roles")) if isinstance(data, dict) \
            else (None, None)
        if (not isinstance(version, int) or not isinstance(roles, dict)
                or not all(isinstance(k, str) and isinstance(v, list)
                           and all(isinstance(a, str) for a in v) for k, v in roles.items())):
            raise BookError(f"address book {self.path}: not a book (expected "
                            '{"version": int, "roles": {kind: [address, ...]}})')
        return version, roles

    def publish(self, roles: Mapping[str, Sequence[str]]) -> int:
        """Write ``roles`` as the book's next version (1 for a new book); returns it."""
        try:
            version = self.read()[0] + 1
        except BookError:
            version = 1
        text = json.dumps({"version": version, "roles": {k: list(v) for k, v in roles.items()}},
                          indent=1)
        write_private_file(self.path, text + "\n")
        return version

    def entry(self, kind: str, index: int) -> BookEntry:
        return BookEntry(self, kind, index)


@dataclass(frozen=True)
class BookEntry:
    """Where replica ``index`` of ``kind`` is, as the book says now."""

    book: AddressBook
    kind: str
    index: int

    def current(self) -> tuple[int, str]:
        """``(book version, address)``; :class:`BookError` naming the book when it has no
        such replica."""
        version, roles = self.book.read()
        addresses = roles.get(self.kind, [])
        if not 0 <= self.index < len(addresses):
            raise BookError(f"address book {self.book.path} (version {version}): no "
                            f"{self.kind} replica {self.index} (it lists {len(addresses)})")
        return version, addresses[self.index]


def servers_now(addresses: Sequence[str], book: AddressBook | None,
                kind: str = PARAMETER_SERVERS) -> list[tuple[str, BookEntry | None]]:
    """Each replica of ``kind`` (``addresses``: where the job started them): where it is
    now (the book's address, when there is a book) and its entry, to follow it later."""
    if book is None:
        return [(a, None) for a in addresses]
    entries = [book.entry(kind, i) for i in range(len(addresses))]
    return [(e.current()[1], e) for e in entries]


def book_at(path: str | None) -> AddressBook | None:
    """The book at ``path`` (``PersiaEnv.address_book``), or None for a role started
    without one (by hand, or by an engine whose servers keep their addresses:
    Kubernetes' names)."""
    return AddressBook(path) if path else None
