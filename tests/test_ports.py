"""Every port a job on one machine opens is bound to loopback, so no other host can reach
it: ``persia-launcher local`` runs on emulated host ``a`` (a network namespace of its own)
and its NN ranks hold once they have joined their process group; the test then lists
every socket listening in host ``a`` (gRPC servers, metrics endpoints, torch's rendezvous
store, gloo's listeners) and dials each from host ``b`` at host ``a``'s address. Every
dial is refused, and the job then trains to its end (its store and gloo work on
loopback)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from checkout import EXAMPLE, ROOT
from child_processes import launcher_command

from persia_py.launcher import ports

pytestmark = pytest.mark.processes

JOB = ROOT / "tests" / "ports_job"
LOOPBACK = ("127.", "[::1]", "[::ffff:127.")

DIAL = """
import json, socket, sys
for port in json.loads(sys.argv[2]):
    try:
        socket.create_connection((sys.argv[1], port), timeout=30).close()
        print(port, "accepted", flush=True)
    except OSError as exc:
        print(port, type(exc).__name__, flush=True)
"""


def listening(namespace: str) -> list[tuple[str, str, int, str]]:
    """(protocol, local address, port, owning command line) of every socket listening in
    ``namespace``."""
    out = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-ltunpH"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        address, _, port = fields[4].rpartition(":")
        pids = re.findall(r"pid=(\d+)", line)
        found.append((fields[0], address, int(port), _command_line(pids[0]) if pids else "?"))
    return found


def _command_line(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def test_a_local_job_opens_no_port_another_host_can_reach(emulated_hosts, tmp_path) -> None:
    network = emulated_hosts("a", "b")
    a, b = network.hosts["a"], network.hosts["b"]
    hold = tmp_path / "hold"
    os.mkfifo(hold)
    # Held open for writing until the ports are probed: rank 0 reads the FIFO to its end.
    writer = os.open(hold, os.O_RDWR)
    try:
        # Host a's name resolves to its network address, as most machines' names do (gloo
        # listens on that address unless told otherwise); a UTS namespace of the job's
        # own keeps the machine's name as it is.
        job = a.start(["unshare", "--uts", "sh", "-c", f'hostname {a.ip} && exec "$@"', "sh",
                       *launcher_command(
            "local", "--nn-worker", str(JOB / "train.py"),
            "--data-loader", str(ROOT / "tests" / "ps_failure_job" / "data_loader.py"),
            "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
            "--global-config", str(EXAMPLE / "global_config.yml"),
            "--num-ps", "1", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"),
            "--data-loader-args", "--batches 8", "--nn-worker-args", f"--hold {hold}")])
        store = int(job.wait_for_line(r"ports open; store on [^:]+:(\d+)", timeout=300).group(1))
        sockets = listening(a.namespace)
        described = "\n".join(f"{p} {addr}:{port} {cmd}" for p, addr, port, cmd in sockets)
        ports = sorted({port for _, _, port, _ in sockets})
        assert store in ports, described
        # Each rank listens for gloo's connections; the launcher and every server role
        # serve metrics, the servers gRPC.
        assert sum(str(JOB / "train.py") in cmd for *_, cmd in sockets) >= 2, described
        dial = b.start([sys.executable, "-c", DIAL, a.ip, json.dumps(ports)])
        assert dial.wait(timeout=300) == 0, dial.output()
        answers = dict(line.split() for line in dial.lines if line.strip())
        reached = {port: answer for port, answer in answers.items()
                   if answer != "ConnectionRefusedError"}
        assert len(answers) == len(ports) and not reached, \
            f"reachable from host b: {reached}\nlistening on host a:\n{described}"
        # The check that does not depend on the dial: every listener is on loopback.
        assert all(addr.startswith(LOOPBACK) for _, addr, _, _ in sockets), described
    finally:
        os.close(writer)
    assert job.wait(timeout=300) == 0, job.output()
    assert job.output().count(" done") >= 2, job.output()


def _ranks(monkeypatch, *flags: str) -> tuple[list[str], int, dict[str, str], int]:
    """What ``persia-launcher nn-worker`` with no torchrun restarts starts without torchrun
    (persia_py/launcher/local_ranks.py): the script and its arguments, the number of
    ranks, their environment, and the port of their store."""
    from persia_py.launcher import roles
    from persia_py.launcher.cli import build_parser
    from persia_py.launcher.role_options import role_options_from_flags

    started = []
    monkeypatch.setattr(roles, "run_ranks", lambda script, nproc, env, port:
                        started.append((script, nproc, env, port)) or 0)
    assert roles.run_nn_worker(role_options_from_flags(build_parser().parse_args(
        ["nn-worker", "--insecure", *flags, "train.py", "--epochs", "2"]))) == 0
    return started[0]


def _nn_worker(monkeypatch, *flags: str) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line and environment ``persia-launcher nn-worker`` runs (with
    one node, only where torchrun restarts the ranks)."""
    from persia_py.launcher import roles
    from persia_py.launcher.cli import build_parser
    from persia_py.launcher.role_options import role_options_from_flags

    started = []
    monkeypatch.setattr(roles, "run_torchrun",
                        lambda command, env, grace_sec: started.append((command, env)) or 0)
    assert roles.run_nn_worker(role_options_from_flags(build_parser().parse_args(
        ["nn-worker", "--insecure", *flags, "train.py"]))) == 0
    return started[0]


def test_one_node_meets_on_loopback_and_several_as_torch_does(monkeypatch) -> None:
    from persia_py.launcher.loopback import loopback_interface

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    # One rank, no restarts: it starts without torchrun, its store on loopback.
    script, nproc, env, port = _ranks(monkeypatch, "--nproc-per-node", "1")
    assert (script, nproc, port) == (["train.py", "--epochs", "2"], 1, 0)
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == loopback_interface()
    assert _ranks(monkeypatch, "--master-port", "29501")[3] == 29501
    # Several ranks, or ranks torchrun restarts: its loopback rendezvous.
    command, _ = _nn_worker(monkeypatch, "--nproc-per-node", "2")
    assert command[1:3] == ["-m", "persia_py.launcher.loopback_torchrun"], command
    command, env = _nn_worker(monkeypatch, "--nproc-per-node", "2", "--max-restarts", "1")
    assert command[1:5] == ["-m", "persia_py.launcher.loopback_torchrun",
                            "--rdzv-backend=persia-loopback", "--rdzv-endpoint=127.0.0.1:0"]
    assert not [a for a in command if a.startswith(("--master", "--node-rank"))], command
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == loopback_interface()
    command, _ = _nn_worker(monkeypatch, "--master-port", "29501", "--max-restarts", "1")
    assert "--rdzv-endpoint=127.0.0.1:29501" in command
    # The user's choice of interface stands.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert _ranks(monkeypatch)[2]["GLOO_SOCKET_IFNAME"] == "eth7"
    assert _nn_worker(monkeypatch, "--max-restarts", "1")[1]["GLOO_SOCKET_IFNAME"] == "eth7"
    # Across machines the store must be reachable: torch's own static rendezvous.
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    command, env = _nn_worker(monkeypatch, "--nnodes", "2", "--master-addr", "10.77.0.1")
    assert command[1:3] == ["-m", "torch.distributed.run"], command
    assert {"--master-addr=10.77.0.1", "--master-port=29500"} <= set(command)
    assert "GLOO_SOCKET_IFNAME" not in env


def test_torchrun_on_loopback_is_told_apart_from_the_ranks_it_starts(monkeypatch) -> None:
    """What the chaos tests kill and the CPU benchmark counts per role: torchrun's agent
    is a wrapper of the training script, not a rank, though the script is in its argv."""
    from benchmarks.role_processes import is_wrapper

    command, _ = _nn_worker(monkeypatch, "--max-restarts", "1")
    assert "train.py" in command and is_wrapper(command)
    assert not is_wrapper([sys.executable, "-u", "train.py"])


def test_the_loopback_rendezvous_takes_one_node_on_loopback_only() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from persia_py.launcher.loopback_torchrun import create_handler

    def params(endpoint: str, max_nodes: int = 1) -> RendezvousParameters:
        return RendezvousParameters("persia-loopback", endpoint, "run", 1, max_nodes)

    with pytest.raises(ValueError, match="one node only"):
        create_handler(params("127.0.0.1:0", max_nodes=2))
    with pytest.raises(ValueError, match="listens on 127.0.0.1"):
        create_handler(params("10.77.0.1:0"))
    handler = create_handler(params("127.0.0.1:0"))
    info = handler.next_rendezvous()
    info.store.set("key", b"value")
    port = info.bootstrap_store_info.master_port
    assert port > 0 and info.bootstrap_store_info.master_addr == "127.0.0.1"
    assert handler.next_rendezvous().store.get("key") == b"value"  # one store for restarts
    assert _listeners(port) == ["127.0.0.1"]


def _listeners(port: int) -> list[str]:
    """Local addresses of this network namespace's TCP sockets listening on ``port``
    (IPv4 in dotted form; IPv6 in /proc's hex)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0))
                                 if len(address) == 8 else address)
    return found


def test_role_ports_lie_below_the_ephemeral_range_where_no_connection_takes_them() -> None:
    # A port in the ephemeral range may be taken by any connect() between the launcher's
    # choice and the role's bind (seen as a parameter server restarting into "Address
    # already in use" on a loaded machine); below it, only an explicit bind takes one.
    span = ports.ephemeral_range()
    assert span is not None, "this kernel's ephemeral range could not be read"
    low = span[0]
    chosen = ports.free_ports(8, "127.0.0.1")
    assert len(set(chosen)) == 8
    assert all(ports.LOWEST_PORT <= port < low for port in chosen), (chosen, low)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # a connection's own port
        with socket.create_connection(listener.getsockname()) as client:
            assert client.getsockname()[1] >= low
    # Where the range leaves no room below it (or cannot be read), any free ports.
    anywhere = ports.free_ports(3, "127.0.0.1", ephemeral=(ports.LOWEST_PORT + 10, 65535))
    assert len(set(anywhere)) == 3 and all(port > 0 for port in anywhere)
    assert ports.ephemeral_range("/nonexistent/ip_local_port_range") is None
