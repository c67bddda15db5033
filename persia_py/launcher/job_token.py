"""The job token as the launcher handles it: required by every role unless ``--insecure``.

:mod:`persia_py.wire.security` checks the token on every call; this module decides, before a
role starts, whether it has one. A role started by hand must be given one (the global
config's ``common_config.auth_token_file``, else ``$PERSIA_AUTH_TOKEN``) or be told
``--insecure``; ``persia-launcher local`` makes a new one per run when none is given and
hands it to its roles by environment (never argv, which every local user can read), and
writes it to a file only its owner can read, for clients started outside the job.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
from collections.abc import Mapping

from persia_py.config import load_global_config
from persia_py.env import ENV_GLOBAL_CONFIG
from persia_py.ops.private_files import write_private_file
from persia_py.wire.security import ENV_AUTH_TOKEN, ENV_INSECURE_TOKEN, TransportSecurity

logger = logging.getLogger("persia_py.launcher")

TOKEN_FILE_NAME = "auth_token"
"""Name of the file ``local`` writes its job token to, inside the run folder."""

_HOW_TO_SET = (
    "set common_config.auth_token_file in the global config to a file that holds the "
    f"token, or export {ENV_AUTH_TOKEN} (make one with: python -c 'import secrets; "
    "print(secrets.token_hex(32))'; never put it on the command line)"
)


def add_insecure_flag(p: argparse.ArgumentParser, what: str, default: str | None = None) -> None:
    """``--insecure``: the explicit opt-out of the job token, for ``what``; ``default``
    says where the token comes from without it (default: the user must give one)."""
    default = default or ("a token is required, from common_config.auth_token_file or "
                          f"${ENV_AUTH_TOKEN}")
    p.add_argument("--insecure", action="store_true",
                   help=f"run {what} without a job token: anyone who can reach its ports can "
                        f"call every RPC (default: {default})")


def add_insecure_token_flag(p: argparse.ArgumentParser) -> None:
    """``--insecure-token``: the explicit opt-out of the token checks (see
    :mod:`persia_py.wire.security`), handed on to every process started below by environment."""
    p.add_argument("--insecure-token", action="store_true",
                   help="accept a job token that is easy to guess (short, a string repeated, "
                        "little randomness) or a token file that group or others may read or "
                        f"write (default: refused); sets {ENV_INSECURE_TOKEN}=1 for this "
                        "process and every process it starts")


def configured_token(global_config: str | None,
                     environ: Mapping[str, str] | None = None) -> str | None:
    """The token the user gave (``auth_token_file``, else ``$PERSIA_AUTH_TOKEN``), if any.

    Raises ConfigError when the config is bad or the token too weak (it names the source).
    """
    common = load_global_config(global_config).common_config
    return TransportSecurity.from_common(common, environ).token


def require_token(what: str, global_config: str | None, insecure: bool) -> None:
    """Stop ``what`` with a message saying how to give it a token, unless it has one or
    was told ``--insecure`` (then a warning says what that exposes)."""
    if configured_token(global_config) is not None:
        return
    if not insecure:
        raise SystemExit(f"{what}: no job token; {_HOW_TO_SET}. To run without one (anyone "
                         "who can reach the ports can then call every RPC), pass --insecure.")
    logger.warning("%s runs WITHOUT a job token (--insecure): anyone who can reach its ports "
                   "can call every RPC", what)


def new_token() -> str:
    """A fresh job token: 256 random bits, hex."""
    return secrets.token_hex(32)


def give_job_token(insecure: bool, env: dict[str, str], run_dir: str) -> list[str]:
    """``local``: give the job its token; returns the flags every role needs for it.

    The user's token (``auth_token_file`` or ``$PERSIA_AUTH_TOKEN``) is used as it is;
    else, unless ``--insecure``, a new one for this run goes into every role's environment
    (never argv: any local user can read that) and into ``<run dir>/auth_token`` (mode
    0600), for clients started outside the job. Its path is printed, never the token.
    """
    if configured_token(env.get(ENV_GLOBAL_CONFIG), env) is not None:
        print("[launcher] job token: the one configured (common_config.auth_token_file or "
              f"${ENV_AUTH_TOKEN})", flush=True)
        return []
    if insecure:
        print("[launcher] WARNING: running WITHOUT a job token (--insecure): any local user "
              "can call every RPC of this job", flush=True)
        return ["--insecure"]
    env[ENV_AUTH_TOKEN] = token = new_token()
    path = write_private_file(os.path.join(run_dir, TOKEN_FILE_NAME), token + "\n")
    print(f"[launcher] job token made for this run: {path} (mode 0600); a client outside "
          f"the job reads it from there (common_config.auth_token_file: {path}, or "
          f"export {ENV_AUTH_TOKEN}=$(cat {path}))", flush=True)
    return []
