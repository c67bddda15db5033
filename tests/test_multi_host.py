"""A job across three emulated hosts, run with the docs' own commands ("Running on
several machines"): it trains the Criteo-shaped example to the test AUC of the same job on
one machine (``persia-launcher local``), over mutual TLS with a job token, and clients on
another host without a certificate or without the token are refused."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time

import pytest
import yaml
from auc_reference import auc_like_reference
from certs import make_tls_files
from checkout import EXAMPLE, ROOT
from child_processes import RoleProcess, launcher_command, stop_all
from grpc_calls import env_without_token
from netns import HOST_IFACE

pytestmark = pytest.mark.processes

SECTION = "## Running on several machines"


def readme_section() -> str:
    text = (ROOT / "docs" / "deployment.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:end if end != -1 else len(text)]


def readme_blocks() -> tuple[str, dict[str, list[str]]]:
    """The global config (YAML) and the command lines of each block, keyed by the block's
    first comment: ``every host``, ``host A``, ... (continuation lines joined)."""
    config, commands = None, {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", readme_section(), re.S):
        if lang == "yaml":
            config = body
            continue
        lines = body.replace("\\\n", " ").splitlines()
        assert lines and lines[0].startswith("# "), f"a bash block names its host first:\n{body}"
        commands[lines[0][2:].strip()] = [line.strip() for line in lines[1:]
                                          if line.strip() and not line.lstrip().startswith("#")]
    assert config is not None and set(commands) == {"every host", "host A", "host B",
                                                    "host C"}, commands
    return config, commands


def substitute(text: str, values: dict[str, str]) -> str:
    """``$NAME`` replaced by ``values[NAME]``; an unknown name fails the test."""
    def value(match: re.Match) -> str:
        assert match.group(1) in values, f"docs/deployment.md uses ${match.group(1)}, unknown to the test"
        return values[match.group(1)]
    return re.sub(r"\$(\w+)", value, text)


def parse_command(line: str) -> tuple[dict[str, str], list[str], bool]:
    """(leading VAR=value assignments, persia-launcher's arguments, runs in background)."""
    tokens = shlex.split(line)
    background = tokens[-1] == "&"
    if background:
        tokens.pop()
    env = {}
    while "=" in tokens[0] and not tokens[0].startswith("-"):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    assert tokens[0] == "persia-launcher", line
    return env, tokens[1:], background


def script_args(args: list[str], script: str) -> str:
    """The arguments after ``script`` in a command, as one string."""
    return shlex.join(args[args.index(script) + 1:])


PROBE = """
import sys, grpc
from persia_py.proto import common_pb2, parameter_server_pb2_grpc
address, ca, cert, key = sys.argv[1:]
read = lambda p: open(p, "rb").read()
mtls = grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key),
                                    certificate_chain=read(cert))
for who, channel in (("plaintext", grpc.insecure_channel(address)),
                     ("no-token", grpc.secure_channel(address, mtls))):
    try:
        parameter_server_pb2_grpc.ParameterServerStub(channel).Health(
            common_pb2.HealthRequest(), timeout=20)
        print(who, "OK", flush=True)
    except grpc.RpcError as exc:
        print(who, exc.code().name, flush=True)
"""


def _auc(proc: RoleProcess) -> float | None:
    found = [line for line in proc.lines if "test_auc:" in line]
    return float(found[-1].split("test_auc:")[1]) if found else None


DATA_LOADER = "examples/criteo_synthetic/data_loader.py"
TRAIN = "examples/criteo_synthetic/train.py"


class ReadmeJob:
    """The README's multi-host job, started on the emulated hosts ``a``, ``b`` and ``c``;
    ``scripts`` may swap the example's scripts (and their arguments) for others."""

    def __init__(self, network, tmp_path, scripts: dict[str, list[str]] | None = None,
                 common_config: dict | None = None) -> None:
        hosts = network.hosts
        self.job = tmp_path / "job"
        self.job.mkdir()
        self.tls = make_tls_files(self.job, ips=[h.ip for h in hosts.values()])
        (self.job / "token").write_text(os.urandom(32).hex() + "\n")
        (self.job / "token").chmod(0o600)
        values = {"JOB": str(self.job), "HOST_A_IP": hosts["a"].ip,
                  "HOST_B_IP": hosts["b"].ip, "HOST_C_IP": hosts["c"].ip,
                  "HOST_B_IFACE": HOST_IFACE, "HOST_C_IFACE": HOST_IFACE}
        config_text, commands = readme_blocks()
        config = yaml.safe_load(substitute(config_text, values))
        assert {k: config["common_config"][k] for k in self.tls} == self.tls
        config["common_config"].update(common_config or {})
        (self.job / "global_config.yml").write_text(yaml.safe_dump(config))
        self.env = env_without_token()
        for line in commands["every host"]:
            assert line.startswith("export "), line
            key, _, value = shlex.split(substitute(line, values))[1].partition("=")
            self.env[key] = value
        self.procs: dict[str, list[RoleProcess]] = {}
        self.args: dict[str, list[list[str]]] = {}
        self.foreground: dict[str, RoleProcess] = {}
        for name in ("a", "b", "c"):
            for line in commands[f"host {name.upper()}"]:
                env, args, background = parse_command(substitute(line, values))
                self.args.setdefault(name, []).append(args)
                for script, replacement in (scripts or {}).items():
                    if script in args:
                        args = args[:args.index(script)] + replacement
                # Rank 0's training log goes to the test's folder, not the working tree.
                # The emulated hosts share this machine's cores, where a real host has its
                # own: a rank's OpenMP pool sized for every core here spins against the
                # other host's rank and the servers, and the job crawls.
                env = {**self.env, **env, "OMP_NUM_THREADS": "1",
                       "PERSIA_TRAIN_LOG": str(tmp_path / f"log-{name}.jsonl")}
                proc = hosts[name].start(launcher_command(*args), env=env)
                self.procs.setdefault(name, []).append(proc)
                if not background:
                    self.foreground[name] = proc
        assert set(self.foreground) == {"b", "c"}, "the NN-worker nodes run in the foreground"

    def wait(self) -> None:
        """Both NN-worker nodes and the data loader end well; the servers still serve."""
        for name, proc in self.foreground.items():
            assert proc.wait(timeout=600) == 0, \
                f"host {name}:\n{proc.output()}\n{self.others(name)}"
        data_loader = self.procs["b"][0]
        assert data_loader.wait(timeout=60) == 0, data_loader.output()
        for proc in self.procs["a"]:
            assert proc.process.poll() is None, f"a server on host A exited:\n{proc.output()}"

    def others(self, but: str) -> str:
        """What every other host's processes printed: a node's failure often starts on
        another one (a rank there died, and this one lost its peer)."""
        return "\n".join(f"--- host {name}, process {i}:\n{proc.output()[-6000:]}"
                         for name, procs in self.procs.items() for i, proc in enumerate(procs)
                         if proc is not self.foreground.get(but))


def test_three_hosts_train_like_one_machine(emulated_hosts, tmp_path) -> None:
    network = emulated_hosts("a", "b", "c")
    hosts = network.hosts
    job = ReadmeJob(network, tmp_path)
    tls, base_env, procs, parsed = job.tls, job.env, job.procs, job.args
    dl_args, nn_args = parsed["b"][0], parsed["b"][1]

    # The same job on one machine: same config, data, roles and ranks; the 3-host job's
    # AUC lies within auc_reference.AUC_TOLERANCE of the range of its runs (auc_like_reference).
    def start_one_machine(name: str) -> RoleProcess:
        return RoleProcess(launcher_command(
            "local", "--nn-worker", str(EXAMPLE / "train.py"),
            "--data-loader", str(EXAMPLE / "data_loader.py"),
            "--embedding-config", base_env["PERSIA_EMBEDDING_CONFIG"],
            "--global-config", str(job.job / "global_config.yml"),
            "--num-ps", "2", "--num-embedding-workers", "1", "--num-data-loaders", "1",
            "--nproc-per-node", "2", "--no-metrics", "--run-dir", str(tmp_path / name),
            "--data-loader-args", script_args(dl_args, DATA_LOADER),
            "--nn-worker-args", script_args(nn_args, TRAIN),
        ), env=base_env)

    def finished_auc(local: RoleProcess) -> float:
        try:
            assert local.wait(timeout=600) == 0, local.output()
        finally:
            local.stop()
        auc = _auc(local)
        assert auc is not None and auc > 0.70, local.output()
        return auc

    # The first reference run goes beside the 3-host job (its own namespace and ports):
    # neither waits for the other's CPU for long, and the AUC check allows for the load.
    beside = [start_one_machine("reference-1")]
    try:
        job.wait()
        aucs = [auc for auc in map(_auc, job.foreground.values()) if auc is not None]
        assert len(aucs) == 1, "\n".join(p.output() for p in job.foreground.values())

        # From host C, which is not host A: no certificate, or no token, gets nothing.
        probe = hosts["c"].start([sys.executable, "-c", PROBE, f"{hosts['a'].ip}:7001",
                                  tls["tls_ca_file"], tls["tls_cert_file"], tls["tls_key_file"]],
                                 env=base_env)
        assert probe.wait(timeout=120) == 0, probe.output()
        assert "plaintext UNAVAILABLE" in probe.output(), probe.output()
        assert "no-token UNAUTHENTICATED" in probe.output(), probe.output()
        stop_all(procs["a"])

        def one_machine(name: str) -> float:
            return finished_auc(beside.pop() if beside else start_one_machine(name))

        auc_like_reference(aucs[0], one_machine)
    finally:
        for local in beside:  # the test failed before its reference finished
            local.stop()


def test_local_addr_is_advertised_and_decides_who_hosts_the_rendezvous(monkeypatch) -> None:
    from persia_py.launcher import roles
    from persia_py.launcher.cli import build_parser
    from persia_py.launcher.role_options import role_options_from_flags

    started = []
    monkeypatch.setattr(roles, "run_torchrun",
                        lambda command, env, grace_sec: started.append(command) or 0)
    for local_addr, is_host in (("10.77.0.2", 1), ("10.77.0.3", 0)):
        args = build_parser().parse_args([
            "nn-worker", "--nnodes", "2", "--rdzv-endpoint", "10.77.0.2:29400",
            "--local-addr", local_addr, "--insecure", "train.py"])
        assert roles.run_nn_worker(role_options_from_flags(args)) == 0
        assert f"--local-addr={local_addr}" in started[-1]
        assert f"--rdzv-conf=is_host={is_host},read_timeout=60,close_timeout=60" in started[-1]
    args = build_parser().parse_args(["nn-worker", "--max-restarts", "1", "--insecure",
                                      "train.py"])
    roles.run_nn_worker(role_options_from_flags(args))
    assert not [a for a in started[-1] if a.startswith(("--local-addr", "--rdzv-conf"))]


NUM_BATCHES = 200
JOB = ROOT / "tests" / "ps_failure_job"  # its scripts number the batches and report them


FLAP_SEC = 5
"""Least time each fault lasts: the README's commands must survive a 5 s flap."""

KEEPALIVE_SEC = 2
"""The link tests' ``common_config.keepalive_sec``: a dead link is found within about
twice this (the default, 10 s, takes up to 20 s a fault; the paths are the same)."""


def test_a_link_down_then_a_partition_lose_and_repeat_no_batch(emulated_hosts, tmp_path) -> None:
    """Host C cut off twice in one job, for at least FLAP_SEC each: first its cable pulled
    (the carrier lost), then behind a switch that drops its frames (every link up: nothing
    tells the hosts). Each time its calls fail, are retried, and go on when it is back."""
    network = emulated_hosts("a", "b", "c")
    host_c = network.hosts["c"]
    job = ReadmeJob(network, tmp_path, scripts={
        DATA_LOADER: [str(JOB / "data_loader.py"), "--batches", str(NUM_BATCHES)],
        TRAIN: [str(JOB / "train.py")]}, common_config={"keepalive_sec": KEEPALIVE_SEC})
    c = job.foreground["c"]
    c.wait_for_line(r"trained step 20\b", timeout=300)
    for fault in ("link down", "partition"):
        def cut(off: bool, fault: str = fault) -> None:
            if fault == "link down":
                network.set_link(host_c, up=not off)
            else:
                network.set_partition(host_c, cut=off)

        cut(True)
        since = time.monotonic()
        try:
            # Keepalive finds the dead connection; host C's calls then fail and are retried.
            c.wait_for_line(r"unavailable \(.*waiting and retrying", timeout=120)
            time.sleep(max(0.0, FLAP_SEC - (time.monotonic() - since)))  # the flap's length
        finally:
            cut(False)
        c.wait_for_line(r"reachable again after [\d.]+ s; calls go on", timeout=120)
        # Training goes on before the next fault.
        for _ in range(2):
            c.wait_for_line(r"trained step \d+", timeout=120)
    job.wait()
    assert f"sent {NUM_BATCHES} batches" in job.procs["b"][0].output()
    ids = []
    for name, proc in job.foreground.items():
        found = re.findall(r"trained batch ids ([\d,]*)", proc.output())
        assert len(found) == 1, f"host {name}:\n{proc.output()}"
        ids += [int(i) for i in found[0].split(",") if i]
    assert sorted(ids) == list(range(NUM_BATCHES))
    # Host C had trained 20 batches when its link first went down, and went on after both.
    c_ids = re.findall(r"trained batch ids ([\d,]*)", c.output())[0]
    assert len(c_ids.split(",")) >= 60, c.output()


RPC_TIMEOUT_SEC = 5
"""The job's ``common_config.rpc_timeout_sec``, what the test waits out after the cut:
host C's calls give up after it, host B's collective after twice it, and host C's node
stops its torchrun (whose rendezvous store, on host B, is out of reach) after it too (5 s
at least). Short, so that the test waits seconds, not minutes; long enough that no call or
collective runs out of it before the cut on a loaded machine (a step takes well under a
second here)."""


def test_a_link_down_past_the_rpc_deadline_stops_the_job_naming_the_peer(
        emulated_hosts, tmp_path) -> None:
    network = emulated_hosts("a", "b", "c")
    hosts = network.hosts
    job = ReadmeJob(network, tmp_path, scripts={
        DATA_LOADER: [str(JOB / "data_loader.py"), "--batches", "100000"],
        TRAIN: [str(JOB / "train.py")]}, common_config={"rpc_timeout_sec": RPC_TIMEOUT_SEC,
                                              "keepalive_sec": KEEPALIVE_SEC})
    b, c = job.foreground["b"], job.foreground["c"]
    c.wait_for_line(r"trained step 10\b", timeout=300)
    network.set_link(hosts["c"], up=False)
    try:
        # Each NN-worker node gives up on its own: no one is left waiting for a peer.
        for name, proc in (("c", c), ("b", b)):
            try:
                code = proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                code = None
            assert code not in (0, None), \
                f"host {name} ({code}):\n{proc.output()}\nhost b:\n{b.output()}"
    finally:
        network.set_link(hosts["c"], up=True)
    # Host C lost host A (its embedding worker) and host B (its data loader): a call
    # failed fast (unavailable) or, the link dead without a reset, ran out its deadline.
    assert re.search(rf"({hosts['a'].ip}|{hosts['b'].ip}):\d+.*(unavailable|did not answer)",
                     c.output()), \
        c.output()
    # Host B's rank waited for host C's rank in the allreduce, and says where it is.
    assert re.search(rf"failed on rank 0: a peer NN-worker rank is unreachable or stalled "
                     rf"\(rank 1 at {hosts['c'].ip}\)", b.output()), b.output()
