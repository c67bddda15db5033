"""pytest's hooks and the fixtures shared by the test modules: the session's job token,
small config files, emulated hosts, the Slurm cluster and the type check; the hooks mark
and guard the tests that start processes, restore SIGINT for them, start the type check
early and group tests for pytest-xdist. Plain helpers live beside this file, each module
for one concept: :mod:`checkout` (ROOT, the example, the package as installed),
:mod:`child_processes` (starting, waiting on and stopping roles), :mod:`grpc_calls` (calls
with or without the job token) and :mod:`auc_reference` (a job's AUC against reference
runs)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkout import drop_stale_kernel_caches, start_type_check

from persia_py.wire.security import ENV_AUTH_TOKEN


@pytest.fixture(scope="session", autouse=True)
def job_token() -> Iterator[str]:
    """Every test runs with a job token in its environment, as a user of the secure default
    does: the roles it starts require one (or ``--insecure``), and clients in the test
    process read it from there. Restored at the end of the session."""
    saved = os.environ.get(ENV_AUTH_TOKEN)
    token = saved or secrets.token_hex(32)
    os.environ[ENV_AUTH_TOKEN] = token
    try:
        yield token
    finally:
        if saved is None:
            os.environ.pop(ENV_AUTH_TOKEN, None)
        else:
            os.environ[ENV_AUTH_TOKEN] = saved


@pytest.fixture
def tmp_configs(tmp_path: Path):
    """Write a small embedding and global config; returns their paths."""

    def write(embedding: str, global_: str = "") -> tuple[str, str]:
        e, g = tmp_path / "embedding_config.yml", tmp_path / "global_config.yml"
        e.write_text(embedding)
        g.write_text(global_)
        return str(e), str(g)

    return write


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "processes: the test starts processes (servers, roles, torchrun, "
        "subprocesses); `pytest -m 'not processes'` runs the unit tests alone, in seconds")
    # pytest-xdist registers it too; here for a run without it (the marks are then inert)
    config.addinivalue_line("markers", "xdist_group(name): tests run by one xdist worker")
    _guard_process_starts()
    _sigint_for_children()
    if not hasattr(config, "workerinput"):  # xdist: once, before its workers start
        drop_stale_kernel_caches()


def _sigint_for_children() -> None:
    """A shell without job control starts a background command (``pytest ... &``) with
    SIGINT ignored, and every process started from it inherits that: a launcher that
    ignores SIGINT makes the tests that press Ctrl-C on a job fail (the report shows
    SIGINT in its SigIgn), as they did in sessions 13 and 15. Caught here, SIGINT is
    back to its default in the processes the tests start (exec resets caught signals)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_running: list[pytest.Item] = []
"""The test being set up, run or torn down (its fixtures included)."""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> None:
    _running[:] = [item]


def _guard_process_starts() -> None:
    """A test that starts a process (itself or through a fixture of any scope) without the
    ``processes`` marker fails, so that ``-m 'not processes'`` really leaves out every test
    that starts one."""
    import multiprocessing.process

    def guarded(original):
        def start(*args, **kwargs):
            if _running and _running[0].get_closest_marker("processes") is None:
                raise AssertionError(f"{_running[0].nodeid} starts a process: mark it (or its "
                                     "module) with @pytest.mark.processes")
            return original(*args, **kwargs)
        return start

    subprocess.Popen.__init__ = guarded(subprocess.Popen.__init__)
    multiprocessing.process.BaseProcess.start = guarded(multiprocessing.process.BaseProcess.start)
    os.fork = guarded(os.fork)


@pytest.fixture
def emulated_hosts(request: pytest.FixtureRequest):
    """Makes emulated hosts: ``emulated_hosts("a", "b")`` returns a :class:`netns.Network`
    with hosts ``a`` (10.77.0.1) and ``b`` (10.77.0.2). Skips where network namespaces cannot
    be made; every process and namespace is removed at the end, whether the test passed or
    not."""
    from netns import NamespacesUnavailable, Network, unavailable_reason

    def make(*names: str) -> Network:
        reason = unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
        network = Network()
        request.addfinalizer(network.close)
        try:
            network.create(names)
        except NamespacesUnavailable as exc:
            pytest.skip(f"cannot make network namespaces here: {exc}")
        return network

    return make


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """A real Slurm cluster on emulated hosts (:mod:`slurm_cluster`), shared by the module's
    tests: slurmctld on ``ctl``, slurmd on ``node1``-``node3``. Each test gets it healthy:
    no job left, every node up and idle. Skips where it cannot be built (not root, no
    network namespaces, Slurm not installed); everything it started is gone at the end of
    the module, whether its tests passed or not."""
    from netns import NamespacesUnavailable
    from slurm_cluster import SlurmCluster, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        try:
            cluster.boot()
        except NamespacesUnavailable as exc:
            pytest.skip(f"cannot make network namespaces here: {exc}")
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def slurm(slurm_cluster):
    """The module's :class:`slurm_cluster.SlurmCluster`, healthy (see ``slurm_cluster``)."""
    slurm_cluster.make_healthy()
    return slurm_cluster


TYPE_CHECK = "tests/test_types.py::test_package_type_checks"
_type_check: list[tuple[subprocess.Popen, Path]] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts the type check (mypy, one process needing only the source) as soon as the
    tests are chosen, if it is one of them: it runs beside the tests before it, whose
    jobs leave part of the cores idle, instead of on its own near the end."""
    if (any(item.nodeid == TYPE_CHECK for item in session.items)
            and not hasattr(session.config, "workerinput")):  # xdist: in the test itself
        _type_check.append(start_type_check(Path(tempfile.mkdtemp(prefix="type-check-"))))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A type check started early whose test did not run (the session stopped first)."""
    for proc, output in _type_check:
        proc.kill()
        proc.wait()
        shutil.rmtree(output.parent, ignore_errors=True)
    _type_check.clear()


@pytest.fixture
def type_check(tmp_path: Path) -> str:
    """What the type check printed, once it exited 0 (started early when it could be)."""
    proc, output = _type_check.pop() if _type_check else start_type_check(tmp_path)
    try:
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = output.read_text()
    if output.parent.name.startswith("type-check-"):  # not a test's own tmp_path
        shutil.rmtree(output.parent, ignore_errors=True)
    assert code == 0, text
    return text


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``scripts/run_tests.sh -n 2 --dist loadgroup``): a
    module's tests run in one worker, so that its module-scoped fixtures (shared jobs) run
    once, and every test on emulated hosts runs in the same one, since they share the hosts'
    addresses."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        group = ("emulated-hosts" if fixtures & {"emulated_hosts", "slurm_cluster"}
                 else item.module.__name__)
        item.add_marker(pytest.mark.xdist_group(group))
