"""Finding the process of one role of a running ``persia-launcher local`` job: what a chaos
test or the recovery benchmark kills, and whose CPU the throughput benchmarks count. Not
part of the package: only tests and benchmarks look for processes this way."""

from __future__ import annotations

from persia_py.env import ENV_DATA_LOADER_REPLICA_INDEX
from persia_py.launcher import role_kinds
from persia_py.launcher.processes import descendants

ROLE_KINDS = tuple(kind.title for kind in role_kinds.ROLE_KINDS)
"""The kinds :func:`role_pid` finds, by title."""


def _argv_env(pid: int) -> tuple[list[str], dict[str, str]]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.partition("=")[::2] for item in
                   f.read().decode(errors="replace").split("\0") if "=" in item)
    return argv, env


WRAPPER_MODULES = ("persia_py.launcher.cli", "torch.distributed.run",
                   "persia_py.launcher.loopback_torchrun")
"""``python -m`` modules that start a user's script rather than run it (the launcher's
role wrappers, torchrun and its loopback variant)."""


def is_wrapper(argv: list[str]) -> bool:
    """Whether the process of command line ``argv`` starts a user's script (see
    :data:`WRAPPER_MODULES`), though the script's path is among its arguments."""
    return any(m in argv for m in WRAPPER_MODULES)


def role_pid(root: int, kind: str, index: int, *, loader_script: str,
             train_script: str) -> int:
    """The process below ``root`` (a ``persia-launcher local``) that *is* replica ``index``
    of role ``kind`` (one of :data:`ROLE_KINDS`): for data loaders and NN ranks the user's
    script (``loader_script``/``train_script``, matched by path suffix), not the wrapper
    or torchrun that started it. What a chaos test or the recovery benchmark kills."""
    role = role_kinds.kind_titled(kind)
    found = []
    for pid in descendants(root):
        try:
            argv, env = _argv_env(pid)
        except OSError:  # exited meanwhile
            continue
        wrapper = is_wrapper(argv)
        if not role.runs_script:
            hit = role.command in argv and argv[argv.index("--replica-index") + 1] == str(index)
        elif role is role_kinds.DATA_LOADER:
            hit = not wrapper and any(a.endswith(loader_script) for a in argv) and \
                env.get(ENV_DATA_LOADER_REPLICA_INDEX) == str(index)
        else:
            hit = not wrapper and any(a.endswith(train_script) for a in argv) and \
                env.get("RANK") == str(index)
        if hit:
            found.append(pid)
    if len(found) != 1:
        raise LookupError(f"{kind} {index}: {len(found)} processes below {root} ({found})")
    return found[0]
