"""A real parameter server in a child process, for benchmarks that go through gRPC."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from persia_py.ops import allocator
from persia_py.wire.security import ENV_AUTH_TOKEN

START_TIMEOUT_S = 120.0


def _forward_lines(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """Pass ``stream``'s lines on until EOF, then ``None``; keeps the pipe from filling."""
    try:
        for line in stream:
            lines.put(line)
    finally:
        lines.put(None)


def _wait_for_port(lines: queue.Queue[str | None], stderr_path: Path) -> int:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise TimeoutError(f"parameter server not ready within {START_TIMEOUT_S:.0f}s; "
                               f"stderr: {stderr_path}") from None
        if line is None:
            tail = stderr_path.read_text()[-2000:]
            raise RuntimeError(f"parameter server exited before it was ready:\n{tail}")
        match = re.search(r"on port (\d+) ready", line)
        if match:
            return int(match.group(1))


@contextlib.contextmanager
def parameter_server_process(workdir: Path, slot: str, dim: int, capacity: int,
                             row_dtype: str = "float32", disk_tier_rows: int = 0,
                             args: tuple[str, ...] = (), internal_shards: int = 1
                             ) -> Iterator[tuple[str, int]]:
    """A parameter server with one slot of ``row_dtype`` rows (``disk_tier_rows``: a
    disk tier of that many rows in ``workdir/tier``; ``internal_shards``: its
    ``num_hashmap_internal_shards``), given ``args`` beside its configs; yields
    ``(address, pid)`` and stops it on exit."""
    embedding_config = workdir / "embedding_config.yml"
    embedding_config.write_text(f"slots_config:\n  {slot}:\n    dim: {dim}\n"
                                f"    row_dtype: {row_dtype}\n")
    global_config = workdir / "global_config.yml"
    text = (f"embedding_parameter_server_config:\n  capacity: {capacity}\n"
            f"  num_hashmap_internal_shards: {internal_shards}\n")
    if disk_tier_rows:
        (workdir / "tier").mkdir(exist_ok=True)
        text += (f"  disk_tier:\n    path: {workdir / 'tier'}\n"
                 f"    capacity_rows: {disk_tier_rows}\n")
    global_config.write_text(text)
    with role_process(workdir, "embedding-parameter-server", [
            "--embedding-config", str(embedding_config),
            "--global-config", str(global_config), *args]) as started:
        yield started


@contextlib.contextmanager
def role_process(workdir: Path, role: str, args: list[str],
                 name: str = "ps") -> Iterator[tuple[str, int]]:
    """A server role of ``persia-launcher`` (``embedding-parameter-server``,
    ``embedding-worker``) on a free port with ``args``; yields ``(address, pid)`` and
    stops it on exit. Its stderr goes to ``workdir/<name>.stderr``."""
    stderr_path = workdir / f"{name}.stderr"
    command = [sys.executable, "-m", "persia_py.launcher.cli", role, "--port", "0", *args]
    lines: queue.Queue[str | None] = queue.Queue()
    # The server requires a job token (secure by default); the benchmark's clients, in
    # this process, read the same one from the environment.
    token_before = os.environ.get(ENV_AUTH_TOKEN)
    os.environ[ENV_AUTH_TOKEN] = token_before or secrets.token_hex(32)
    with contextlib.ExitStack() as restore, open(stderr_path, "w") as stderr:
        if token_before is None:
            restore.callback(os.environ.pop, ENV_AUTH_TOKEN, None)
        # With the malloc settings ``persia-launcher local`` gives its roles.
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env=allocator.with_tunables(dict(os.environ)))
        reader = threading.Thread(target=_forward_lines, args=(proc.stdout, lines),
                                  name=f"{name}-stdout")
        reader.start()
        try:
            yield f"127.0.0.1:{_wait_for_port(lines, stderr_path)}", proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
            reader.join(timeout=30)
