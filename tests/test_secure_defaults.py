"""Secure defaults of the trust boundary (issue 14's last item; the attacks on the servers
are in ``tests/test_trust_boundary.py``): a role started by hand needs a job token or an
explicit ``--insecure``; ``persia-launcher local`` makes a token per run that only its
roles (and whoever can read its 0600 file) have and that no process's argv shows. The
k8s manifest's token Secret, TLS and NetworkPolicy are in ``tests/test_k8s.py``."""

from __future__ import annotations

import secrets
import subprocess
import textwrap
from pathlib import Path

import grpc
import pytest
from checkout import EXAMPLE
from child_processes import RoleProcess, launcher_command, processes_with_marker, start_server
from grpc_calls import env_without_token

from persia_py.config import CommonConfig
from persia_py.launcher.job_token import give_job_token
from persia_py.ops.start_checks import CONFIG_EXIT_CODE
from persia_py.proto import common_pb2
from persia_py.wire.rpc import create_channel
from persia_py.wire.security import ENV_AUTH_TOKEN

processes = pytest.mark.processes

# The k8s manifest's token Secret, TLS and NetworkPolicy: tests/test_k8s.py (no processes).

EXAMPLE_CONFIGS = ["--embedding-config", str(EXAMPLE / "embedding_config.yml"),
                   "--global-config", str(EXAMPLE / "global_config.yml")]


def _health(channel: grpc.Channel, service: str) -> common_pb2.HealthResponse:
    return channel.unary_unary(
        f"/persia_py.{service}/Health",
        request_serializer=common_pb2.HealthRequest.SerializeToString,
        response_deserializer=common_pb2.HealthResponse.FromString,
    )(common_pb2.HealthRequest(), timeout=10)


@processes
@pytest.mark.parametrize("role", [
    ["embedding-parameter-server"], ["embedding-worker", "--ps-addrs", "127.0.0.1:1"],
    ["data-loader", "loader.py"], ["nn-worker", "train.py"],
    ["serve", "--checkpoint", "ckpt", "--model", "m:f"],
])
def test_a_role_started_by_hand_refuses_to_start_without_a_token(role: list[str]) -> None:
    command = launcher_command(role[0], *EXAMPLE_CONFIGS, *role[1:])
    done = subprocess.run(command, env=env_without_token(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert f"persia-launcher {role[0]}: no job token" in done.stderr, done.stderr
    for how in ("common_config.auth_token_file", ENV_AUTH_TOKEN, "--insecure"):
        assert how in done.stderr, done.stderr


@processes
def test_a_weak_token_is_refused_naming_where_it_came_from() -> None:
    done = subprocess.run(launcher_command("embedding-parameter-server", *EXAMPLE_CONFIGS),
                          env={**env_without_token(), ENV_AUTH_TOKEN: "short"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == CONFIG_EXIT_CODE
    assert f"{ENV_AUTH_TOKEN}: the job token is too easy to guess" in done.stderr, done.stderr


@processes
def test_a_loose_token_file_is_refused_and_insecure_token_accepts_it(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o644)  # as a plain `echo ... > token` leaves it
    config = tmp_path / "global_config.yml"
    config.write_text(f"common_config:\n  auth_token_file: {token}\n")
    flags = ["--embedding-config", str(EXAMPLE / "embedding_config.yml"),
             "--global-config", str(config)]
    done = subprocess.run(launcher_command("embedding-parameter-server", *flags),
                          env=env_without_token(), capture_output=True, text=True, timeout=120)
    assert done.returncode == CONFIG_EXIT_CODE
    assert (f"auth_token_file {str(token)!r}: readable or writable by group or others (mode "
            "0644)") in done.stderr, done.stderr
    # The explicit opt-out, handed on by environment (also to what a role starts).
    ps, _ = start_server("embedding-parameter-server", *flags, "--insecure-token",
                         env=env_without_token())
    ps.stop()


@processes
def test_insecure_is_an_explicit_opt_out_with_a_warning() -> None:
    ps, port = start_server("embedding-parameter-server", *EXAMPLE_CONFIGS, "--insecure",
                            env=env_without_token())
    try:
        assert "WITHOUT a job token (--insecure)" in ps.output()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")  # no token at all: served
        try:
            assert _health(channel, "ParameterServer").role
        finally:
            channel.close()
    finally:
        ps.stop()


def test_local_uses_the_users_token_or_makes_one_or_none_when_told(tmp_path: Path) -> None:
    users = secrets.token_hex(32)
    given = {ENV_AUTH_TOKEN: users}
    assert give_job_token(False, given, str(tmp_path)) == []
    assert given == {ENV_AUTH_TOKEN: users} and not list(tmp_path.iterdir())

    env: dict[str, str] = {}
    assert give_job_token(True, env, str(tmp_path)) == ["--insecure"]
    assert env == {} and not list(tmp_path.iterdir())

    assert give_job_token(False, env, str(tmp_path)) == []
    token_file = tmp_path / "auth_token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert token_file.read_text() == env[ENV_AUTH_TOKEN] + "\n"
    assert len(env[ENV_AUTH_TOKEN]) == 64
    # A second run in the same folder replaces a link planted there; it never writes through it.
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    token_file.unlink()
    token_file.symlink_to(target)
    second: dict[str, str] = {}
    give_job_token(False, second, str(tmp_path))
    assert target.read_text() == "keep" and not token_file.is_symlink()
    assert token_file.read_text() == second[ENV_AUTH_TOKEN] + "\n" != env[ENV_AUTH_TOKEN]


@processes
def test_local_refuses_a_token_on_its_command_line(tmp_path: Path) -> None:
    done = subprocess.run(launcher_command(
        "local", "--nn-worker", "t.py", "--data-loader", "d.py", *EXAMPLE_CONFIGS,
        "--run-dir", str(tmp_path), "--env", f"{ENV_AUTH_TOKEN}={'b' * 32}"),
        env=env_without_token(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and f"--env {ENV_AUTH_TOKEN}=...: a token on the command " \
        "line" in done.stderr, done.stderr


# Both scripts call a server of the job with the token their environment holds, say so,
# and stay up until the launcher stops them.
AUTHENTICATED_SCRIPT = textwrap.dedent("""
    import os, sys, threading
    from persia_py.config import CommonConfig
    from persia_py.proto import common_pb2
    from persia_py.wire.rpc import create_channel

    service, variable = sys.argv[1], sys.argv[2]
    address = os.environ[variable].split(",")[0]
    channel = create_channel(address, CommonConfig())
    channel.unary_unary(
        f"/persia_py.{service}/Health",
        request_serializer=common_pb2.HealthRequest.SerializeToString,
        response_deserializer=common_pb2.HealthResponse.FromString,
    )(common_pb2.HealthRequest(), timeout=60, wait_for_ready=True)
    print(f"{service} authenticated", flush=True)
    threading.Event().wait()
""")


@processes
def test_local_makes_a_token_its_roles_get_by_environment_never_by_argv(tmp_path: Path) -> None:
    script = tmp_path / "authenticated.py"
    script.write_text(AUTHENTICATED_SCRIPT)
    run_dir = tmp_path / "run"
    job = RoleProcess(launcher_command(
        "local", "--nn-worker", str(script), "--nn-worker-args",
        "EmbeddingWorker PERSIA_EMBEDDING_WORKER_ADDRS", "--data-loader", str(script),
        "--data-loader-args", "ParameterServer PERSIA_PS_ADDRS", *EXAMPLE_CONFIGS,
        "--run-dir", str(run_dir), "--no-metrics"), env=env_without_token())
    try:
        for _ in range(2):  # the NN worker's rank and the data loader
            job.wait_for_line(r"authenticated", timeout=300)
        output = job.output()
        assert "[nn-worker] EmbeddingWorker authenticated" in output, output
        assert "[data-loader-0] ParameterServer authenticated" in output, output
        token_file = run_dir / "auth_token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        assert len(token) == 64 and str(token_file) in output and token not in output

        pids = processes_with_marker(job.marker)
        assert len(pids) >= 6  # launcher, PS, EW, data loader, nn-worker, rank
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert token.encode() not in f.read(), pid

        (ps_port,) = {line.split("on port ")[1].split()[0] for line in job.lines
                      if line.startswith("[ps-0]") and " ready" in line}
        address = f"127.0.0.1:{ps_port}"
        anonymous = grpc.insecure_channel(address)
        with pytest.raises(grpc.RpcError) as refused:
            _health(anonymous, "ParameterServer")
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        anonymous.close()
        # A client outside the job reads the token from the file local wrote.
        trusted = create_channel(address, CommonConfig(auth_token_file=str(token_file)))
        assert _health(trusted, "ParameterServer").role
        trusted.close()

        assert job.interrupt(timeout=60) != 0
        assert processes_with_marker(job.marker) == [], job.output()
    finally:
        job.stop()
