"""``Registry``: the house's extension points, each a table of named entries.

An optimizer or a row storage type is added by one registration in its registry; every
place that picks behaviour by kind looks the kind up there instead of testing types in
an if-chain, whose last branch would take an unknown kind for the one it happens to
test last. Entries are registered when their module is imported and never change after.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

_T = TypeVar("_T")


class Registry(Generic[_T]):
    """Entries by name; looking up a name not registered raises ValueError naming the
    registered ones."""

    def __init__(self, what: str) -> None:
        self.what = what
        """What an entry is, for messages (``"optimizer"``, ``"row_dtype"``)."""
        self._entries: dict[str, _T] = {}

    def register(self, name: str, entry: _T) -> _T:
        """Add ``entry`` as ``name`` (returned); ValueError if the name is taken."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what}: a registered name must be a non-empty string, "
                             f"got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is registered already")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: object) -> _T:
        if isinstance(name, str) and name in self._entries:
            return self._entries[name]
        raise ValueError(f"{self.what}: expected one of {self.names()}, got {name!r}")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def items(self) -> list[tuple[str, _T]]:
        return list(self._entries.items())
