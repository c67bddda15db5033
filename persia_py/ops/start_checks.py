"""Config checks that depend on where a role runs, made as it starts; and (from
:mod:`persia_py.ops.final_errors`) the exit code of a role that stops on a config error.

A config file is checked key by key when it is read (:mod:`persia_py.config`). A few keys
are right or wrong only relative to the process that uses them: ``checkpoint_config.dir``
and ``incremental_dir`` must lie in the job's checkpoint root, which is
``checkpoint_config.root`` or, unset, the current directory of each process (a parameter
server's ``--checkpoint-root`` overrides it). Left to the first checkpoint, such an error
would cost the training up to it, and a supervisor would restart the job into the same
error. So ``persia-launcher local`` checks them before it starts any process, each
``persia-launcher`` role as it starts, and ``TrainCtx`` when it is made; and a role that
stops on a config error before it made any progress (a user's script too:
:mod:`persia_py.ops.final_errors`) exits with :data:`CONFIG_EXIT_CODE`, which
``persia-launcher local`` and the Kubernetes manifests take as final: no restart (it
would stop the same way).
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path, PurePath, PurePosixPath

from persia_py.config import CheckpointConfig, ConfigError
from persia_py.ops import safe_files
from persia_py.ops.final_errors import CONFIG_EXIT_CODE, RANK_CONFIG_ERROR

__all__ = ["CONFIG_EXIT_CODE", "RANK_CONFIG_ERROR", "check_checkpoint_paths"]


_RULES = {
    # key -> (allowed depths below the root, the rule in words)
    "dir": ((0, 1), "the root or a folder directly in it (ROOT or ROOT/NAME; its "
                    "checkpoints are folders in it)"),
    "incremental_dir": ((1, 2), "a folder in the root (ROOT/NAME or ROOT/NAME/NAME)"),
}


def _plain(name: str) -> bool:
    try:
        safe_files.check_name(name, "folder")
    except safe_files.InvalidName:
        return False
    return True


def check_checkpoint_paths(config: CheckpointConfig, *, root: str | os.PathLike | None = None,
                           pod_dir: str | None = None) -> None:
    """ConfigError (naming the key, its value and the rule) unless ``checkpoint_config.dir``
    and ``incremental_dir`` lie where the servers can write them: in the checkpoint root
    ``root`` (a server's ``--checkpoint-root``; None: ``config.root``, else the current
    directory), each folder on the way a plain name.

    ``pod_dir``: check the paths as written, for processes that run elsewhere with this
    folder as their current directory (Kubernetes pods: the image's ``WORKDIR``); links
    are not resolved then."""
    given = root if root is not None else config.root
    if root is not None:
        where = "the server's --checkpoint-root"
    elif config.root is not None:
        where = "checkpoint_config.root"
    else:
        where = ("checkpoint_config.root is unset: the current directory" if pod_dir is None
                 else "checkpoint_config.root is unset: the pods' working directory")
    base: PurePath
    if pod_dir is None:
        local_root = safe_files.configured_root(given)
        if local_root.exists() and not local_root.is_dir():  # the servers would fail to make it
            raise ConfigError(f"checkpoint_config.root: {os.fspath(given or '.')!r} ({where}) "
                              "is a file; the checkpoint root must be a folder")
        base = local_root
    else:
        base = PurePosixPath(posixpath.normpath(posixpath.join(pod_dir, given or ".")))
    path: PurePath
    problem: str | None
    for key, (depths, rule) in _RULES.items():
        value = getattr(config, key)
        if value is None:
            continue
        if pod_dir is None:
            path = Path(os.path.realpath(value))
        else:
            path = PurePosixPath(posixpath.normpath(posixpath.join(pod_dir, value)))
        parts = path.relative_to(base).parts if path.is_relative_to(base) else None
        if parts is None:
            problem = "lies outside"
        elif not parts and 0 not in depths:
            problem = "is"
        elif len(parts) not in depths:
            problem = "lies too deep in"
        else:
            problem = next((f"has {part!r}, not a plain name (letters, digits, '_', '.', "
                            "'-'), on its way from" for part in parts
                            if not _plain(part)), None)
        if problem is not None:
            raise ConfigError(
                f"checkpoint_config.{key}: {value!r} {problem} the checkpoint root {base} "
                f"({where}); it must be {rule}. The parameter servers read and write only "
                "inside the root: set checkpoint_config.root to a folder that holds it, or "
                "move it there")
