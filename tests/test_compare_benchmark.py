"""The pieces of ``benchmarks.compare``: each role's CPU over the timed window only, read
from /proc for real processes, and REF checked out importable beside the working tree."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from checkout import ROOT

from benchmarks.compare import checkout, remove
from benchmarks.role_cpu import ROLES, OwnNetwork, _Window, own_network_unavailable, role_of, run_job
from benchmarks.train_throughput import _configs
from persia_py.config import load_global_config

_JOB = textwrap.dedent("""
    import subprocess, sys, time
    def burn(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
    if sys.argv[1:2] == ["ps2"]:  # its child, of the same role
        burn(0.5)
        sys.exit(0)
    if sys.argv[1:2] == ["ps"]:  # a child the classifier takes for a parameter server
        burn(0.1)
        subprocess.run([sys.executable, __file__, "ps2", "embedding-parameter-server"])
        sys.exit(0)
    burn(0.4)  # before the window: must not count
    print("timing_started", flush=True)
    child = subprocess.Popen([sys.executable, __file__, "ps", "embedding-parameter-server"])
    child.wait()
    print("samples_per_sec: 100.0 samples: 2000 staleness_mean: 1.00", flush=True)
""")


_SEND = textwrap.dedent("""
    import socket, sys
    num_bytes = int(sys.argv[1])
    server = socket.create_server(("127.0.0.1", 0))  # to itself over loopback, all read back
    with socket.create_connection(server.getsockname()) as out:
        into, _ = server.accept()
        out.sendall(b"x" * num_bytes)
        out.shutdown(socket.SHUT_WR)
        while into.recv(1 << 16):
            pass
""")
_FIGURES_JOB = textwrap.dedent("""
    print("figures: table_rows=12 step_ms_p50=1.5e1", flush=True)
    print("timing_started", flush=True)
    print("samples_per_sec: 10.0 samples: 100", flush=True)
    print("figures: step_ms_p99=40", flush=True)  # after the last line: still read
""")


@pytest.mark.processes
def test_a_job_of_its_own_network_sends_over_its_own_loopback_only(tmp_path) -> None:
    reason = own_network_unavailable()
    if reason is not None:
        pytest.skip(reason)
    network = OwnNetwork()
    try:
        def send(num_bytes: int) -> None:
            subprocess.run(network.run_in([sys.executable, "-c", _SEND, str(num_bytes)]),
                           check=True, timeout=120)

        send(2_000_000)  # before the first count: not in the difference
        before = network.bytes_sent()
        send(300_000)
        sent = network.bytes_sent() - before
    finally:
        network.close()
    # the 300 kB and their TCP/IP headers; nothing of the host's loopback, busy beside it
    assert 300_000 <= sent < 1_000_000, sent


@pytest.mark.processes
def test_figures_lines_are_read_and_the_network_counted(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_FIGURES_JOB)
    own_network = own_network_unavailable() is None
    result = run_job([sys.executable, str(script)], cwd=str(tmp_path), env=None, what="job",
                     train_script="train.py", loader_script="loader.py",
                     own_network=own_network)
    assert result.figures == {"table_rows": 12.0, "step_ms_p50": 15.0, "step_ms_p99": 40.0}
    assert (result.network_bytes is not None) == own_network


def test_role_of_names_each_role_of_a_local_job() -> None:
    def of(*argv: str) -> str:
        return role_of(list(argv), train_script="train.py", loader_script="loader.py")

    assert of("python", "-m", "persia_py.launcher.cli", "embedding-parameter-server") == \
        "parameter_server"
    assert of("python", "-m", "persia_py.launcher.cli", "embedding-worker") == \
        "embedding_worker"
    assert of("python", "/x/loader.py") == "data_loader"
    assert of("python", "/x/train.py", "--workload", "w") == "nn_worker"
    # the wrappers that start the scripts are the launcher's, not the roles'
    assert of("python", "-m", "persia_py.launcher.cli", "data-loader", "/x/loader.py") == \
        "launcher"
    assert of("python", "-m", "torch.distributed.run", "/x/train.py") == "launcher"


@pytest.mark.processes
def test_cpu_is_counted_per_role_inside_the_window_only(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    result = run_job([sys.executable, str(script)], cwd=str(tmp_path), env=None, what="job",
                     train_script="train.py", loader_script="loader.py")
    assert result.samples == 2000 and result.samples_per_sec == 100.0
    assert set(result.cpu_sec) == set(ROLES)
    # the child and its own child burnt 0.6 s inside the window, all of it counted once
    # though they exit between two polls (the CPU after their last poll is read from
    # their parents' children's CPU once reaped); the parent's 0.4 s before it is left out
    assert 0.58 <= result.cpu_sec["parameter_server"] <= 0.9, result.cpu_sec
    assert result.cpu_sec["launcher"] < 0.3, result.cpu_sec
    per = result.cpu_per_1000()
    assert abs(per["all"] - sum(per[r] for r in ROLES)) < 1e-9


@pytest.mark.processes
def test_a_ref_is_checked_out_importable_and_removed(tmp_path) -> None:
    tree = checkout("HEAD", tmp_path / "ref")
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import persia_py, persia_py.servers.storage as s; "
             "print(persia_py.__file__, s.__file__)"],
            env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, capture_output=True,
            text=True, cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr
        assert all(path.startswith(str(tree)) for path in done.stdout.split()), done.stdout
    finally:
        remove(tree)
    assert not tree.exists()
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True,
                            text=True).stdout
    assert str(tree) not in listed


_EXEC_LATER = textwrap.dedent("""
    import os, sys
    sys.stdin.readline()  # polled here with the command line it was started with
    burn = "import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass"
    os.execv(sys.executable, [sys.executable, "-c", burn, "embedding-parameter-server"])
""")


@pytest.mark.processes
def test_a_process_polled_before_its_exec_counts_for_the_role_it_becomes(tmp_path) -> None:
    """A role's process polled between fork and exec shows the launcher's command line;
    once it has its own, its CPU is its role's."""
    child = subprocess.Popen([sys.executable, "-c", _EXEC_LATER], stdin=subprocess.PIPE)
    try:
        window = _Window(child.pid, train_script="train.py", loader_script="loader.py")
        window.poll(baseline=True)
        assert window.role[child.pid] == "launcher"
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        child.stdin.flush()
        while True:  # polled while it burns, as run_job's poller does
            window.poll()
            try:
                child.wait(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                pass
    finally:
        child.kill()
        child.wait(timeout=30)
    assert window.role[child.pid] == "parameter_server"
    assert window.seconds()["parameter_server"] > 0.2, window.seconds()


@pytest.mark.parametrize("shared_memory", [True, False])
def test_the_jobs_global_config_says_whether_arrays_go_through_shared_memory(
        tmp_path, shared_memory: bool) -> None:
    # benchmarks.scaling --no-shared-memory: its network figure is then what roles on
    # different hosts would send each other
    _, path = _configs(tmp_path, "embedding_heavy", max_message_bytes=1 << 30,
                       shared_memory=shared_memory)
    common = load_global_config(path).common_config
    assert common.shared_memory is shared_memory
    assert common.max_message_bytes == 1 << 30 and common.embedding_fp16
