"""TLS and the job token over real processes: trusted clients train; a plaintext client, a
client without a certificate or with one from another CA, and a client with no or a wrong
token are refused, and the parameter server's rows are unchanged by their attempts."""

from __future__ import annotations

import hashlib
import os
import secrets

import grpc
import numpy as np
import pytest
import yaml
from certs import make_tls_files
from child_processes import start_server
from grpc_calls import env_without_token

from persia_py.config import CommonConfig, ConfigError, global_config_from_dict
from persia_py.launcher.cli import build_parser
from persia_py.proto import (
    common_pb2,
    embedding_worker_pb2,
    embedding_worker_pb2_grpc,
    parameter_server_pb2,
    parameter_server_pb2_grpc,
)
from persia_py.wire import codec
from persia_py.wire.rpc import create_channel
from persia_py.wire.security import ENV_AUTH_TOKEN, ENV_INSECURE_TOKEN, TransportSecurity
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.ps_client import PSClient, configure_request

EMBEDDING_CONFIG = "slots_config:\n  user:\n    dim: 4\n  item:\n    dim: 8\n"
KNOWN_IDS = np.arange(1, 65, dtype=np.uint64)


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory):
    """A PS (token from auth_token_file) and an embedding worker (token from the
    environment), both TLS-only; yields (ps address, ew address, trusted config, files)."""
    root = tmp_path_factory.mktemp("secure")
    tls = make_tls_files(root)
    token = secrets.token_hex(32)
    (root / "token").write_text(token + "\n")
    (root / "token").chmod(0o600)
    (root / "embedding_config.yml").write_text(EMBEDDING_CONFIG)
    common = dict(tls, rpc_timeout_sec=20, startup_timeout_sec=60)
    (root / "ps_global.yml").write_text(yaml.safe_dump(
        {"common_config": dict(common, auth_token_file=str(root / "token"))}))
    (root / "ew_global.yml").write_text(yaml.safe_dump({"common_config": common}))
    env = env_without_token()
    emb = ["--embedding-config", str(root / "embedding_config.yml")]
    procs = []
    try:
        ps, ps_port = start_server("embedding-parameter-server", *emb,
                                   "--global-config", str(root / "ps_global.yml"), env=env)
        procs.append(ps)
        ew, ew_port = start_server("embedding-worker", *emb,
                                   "--global-config", str(root / "ew_global.yml"),
                                   "--ps-addrs", f"127.0.0.1:{ps_port}",
                                   env=dict(env, **{ENV_AUTH_TOKEN: token}))
        procs.append(ew)
        trusted = CommonConfig(**common, auth_token_file=str(root / "token"))
        yield f"127.0.0.1:{ps_port}", f"127.0.0.1:{ew_port}", trusted, dict(tls, root=root,
                                                                                token=token)
    finally:
        for proc in procs:
            proc.stop()


def _ps_checksum(address: str, common: CommonConfig) -> tuple[int, str]:
    """(rows stored, sha256 of the known ids' rows), read without inserting anything."""
    client = PSClient(address, common)
    try:
        entries = sum(t.entries for t in client.stats().tables)
        rows = client.lookup([("user", KNOWN_IDS), ("item", KNOWN_IDS)], training=False)
        return entries, hashlib.sha256(b"".join(r.tobytes() for r in rows)).hexdigest()
    finally:
        client.close()


@pytest.mark.processes
def test_tls_and_token_train_end_to_end_and_refuse_everyone_else(secure_cluster, monkeypatch):
    monkeypatch.delenv(ENV_AUTH_TOKEN, raising=False)
    ps_addr, ew_addr, trusted, files = secure_cluster
    ew = EmbeddingWorkerClient(ew_addr, trusted)
    ew.wait_ready()
    ew.configure(configure_request({"type": "sgd", "lr": 0.5}, init_lower=-0.1, init_upper=0.1,
                                   weight_bound=None, seed=3))
    lengths = np.ones(KNOWN_IDS.size, np.int32)
    ref = ew.put_batch([("user", KNOWN_IDS, lengths), ("item", KNOWN_IDS, lengths)],
                       KNOWN_IDS.size, True)
    slots = ew.lookup(ref)
    assert ew.update_gradients(ref, [(s.slot, np.ones_like(s.rows)) for s in slots]) == 128
    ps = PSClient(ps_addr, trusted)
    rows_after = ps.lookup([("user", KNOWN_IDS)], training=False)[0]
    ps.close()
    np.testing.assert_allclose(rows_after, slots[0].rows - 0.5, rtol=1e-6)
    ew.close()
    before = _ps_checksum(ps_addr, trusted)
    assert before[0] == 128

    ca = open(files["tls_ca_file"], "rb").read()
    key = open(files["tls_key_file"], "rb").read()
    cert = open(files["tls_cert_file"], "rb").read()
    rogue = make_tls_files(files["root"], prefix="rogue-")
    rogue_creds = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=open(rogue["tls_key_file"], "rb").read(),
        certificate_chain=open(rogue["tls_cert_file"], "rb").read())
    (files["root"] / "wrong-token").write_text(secrets.token_hex(32))
    (files["root"] / "wrong-token").chmod(0o600)
    intruders = {
        "plaintext": (grpc.insecure_channel, (), grpc.StatusCode.UNAVAILABLE),
        "TLS without a client certificate": (
            grpc.secure_channel, (grpc.ssl_channel_credentials(root_certificates=ca),),
            grpc.StatusCode.UNAVAILABLE),
        "TLS with another CA's certificate": (grpc.secure_channel, (rogue_creds,),
                                              grpc.StatusCode.UNAVAILABLE),
        "mutual TLS, no token": (
            grpc.secure_channel,
            (grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                          certificate_chain=cert),),
            grpc.StatusCode.UNAUTHENTICATED),
    }
    new_ids = np.arange(10_000, 10_050, dtype=np.uint64)
    requests = {
        "Lookup": parameter_server_pb2.LookupRequest(
            tables=[parameter_server_pb2.TableIds(table="user", ids=codec.encode(new_ids))],
            training=True),
        "Update": parameter_server_pb2.UpdateRequest(tables=[parameter_server_pb2.TableGradients(
            table="user", ids=codec.encode(KNOWN_IDS),
            grads=codec.encode(np.ones((KNOWN_IDS.size, 4), np.float32)))]),
        "Configure": configure_request({"type": "sgd", "lr": 9.0}, init_lower=-1, init_upper=1,
                                       weight_bound=None, seed=1),
    }

    def attempt(channel: grpc.Channel, expected: grpc.StatusCode, who: str) -> None:
        ps = parameter_server_pb2_grpc.ParameterServerStub(channel)
        for method, request in requests.items():
            with pytest.raises(grpc.RpcError) as info:
                getattr(ps, method)(request, timeout=10)
            assert info.value.code() == expected, (who, method, info.value.details())
        ew_stub = embedding_worker_pb2_grpc.EmbeddingWorkerStub(channel)
        put = embedding_worker_pb2.PutBatchRequest(
            features=[codec.encode_id_feature("user", new_ids, np.ones(50, np.int32)),
                      codec.encode_id_feature("item", new_ids, np.ones(50, np.int32))],
            batch_size=50, requires_grad=True)
        with pytest.raises(grpc.RpcError) as info:
            ew_stub.PutBatch(put, timeout=10)
        assert info.value.code() == expected, (who, "PutBatch", info.value.details())

    for who, (make, args, expected) in intruders.items():
        for address in (ps_addr, ew_addr):
            channel = make(address, *args)
            attempt(channel, expected, f"{who} -> {address}")
            channel.close()
    wrong = CommonConfig(**{k: getattr(trusted, k) for k in (
        "tls_cert_file", "tls_key_file", "tls_ca_file", "rpc_timeout_sec")},
        auth_token_file=str(files["root"] / "wrong-token"))
    for address in (ps_addr, ew_addr):
        channel = create_channel(address, wrong)
        attempt(channel, grpc.StatusCode.UNAUTHENTICATED, f"wrong token -> {address}")
        with pytest.raises(grpc.RpcError) as info:
            parameter_server_pb2_grpc.ParameterServerStub(channel).Health(
                common_pb2.HealthRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "wrong job token" in info.value.details()
        channel.close()

    assert _ps_checksum(ps_addr, trusted) == before


def test_token_comes_from_file_then_environment_and_is_checked(tmp_path) -> None:
    token = secrets.token_urlsafe(24)
    assert TransportSecurity.from_common(CommonConfig(), {}).token is None
    assert TransportSecurity.from_common(CommonConfig(), {ENV_AUTH_TOKEN: token}).token == token
    (tmp_path / "t").write_text(f"{token}\n")
    (tmp_path / "t").chmod(0o600)
    from_file = TransportSecurity.from_common(CommonConfig(auth_token_file=str(tmp_path / "t")),
                                              {ENV_AUTH_TOKEN: "ignored-because-file-wins"})
    assert from_file.token == token and token not in repr(from_file)
    with pytest.raises(ConfigError, match=f"{ENV_AUTH_TOKEN}: the job token is too easy to "
                       "guess \\(fewer than 16 characters\\)"):
        TransportSecurity.from_common(CommonConfig(), {ENV_AUTH_TOKEN: "short"})
    (tmp_path / "spaced").write_text("a token with spaces in it")
    (tmp_path / "spaced").chmod(0o600)
    with pytest.raises(ConfigError, match="auth_token_file"):
        TransportSecurity.from_common(CommonConfig(auth_token_file=str(tmp_path / "spaced")), {})


@pytest.mark.parametrize("weak, why", [
    ("a" * 16, "a shorter string repeated"), ("passwordpassword", "a shorter string repeated"),
    ("0123456789abcdef", "about 5 bits of randomness in its characters, fewer than 32"),
    ("hunter2", "fewer than 16 characters"),
])
def test_a_token_easy_to_guess_is_refused_unless_insecure_token(weak: str, why: str) -> None:
    with pytest.raises(ConfigError) as refused:
        TransportSecurity.from_common(CommonConfig(), {ENV_AUTH_TOKEN: weak})
    assert str(refused.value) == (
        f"{ENV_AUTH_TOKEN}: the job token is too easy to guess ({why}); make one with "
        "python -c 'import secrets; print(secrets.token_hex(32))', or pass --insecure-token "
        f"({ENV_INSECURE_TOKEN}=1) to accept it")
    accepted = TransportSecurity.from_common(CommonConfig(), {ENV_AUTH_TOKEN: weak,
                                                              ENV_INSECURE_TOKEN: "1"})
    assert accepted.token == weak
    for strong in (secrets.token_hex(8), secrets.token_hex(32), secrets.token_urlsafe(24)):
        assert TransportSecurity.from_common(CommonConfig(), {ENV_AUTH_TOKEN: strong}).token


def test_a_token_file_others_can_use_is_refused_unless_insecure_token(tmp_path,
                                                                     monkeypatch) -> None:
    path = tmp_path / "token"
    path.write_text(secrets.token_hex(32) + "\n")
    config = CommonConfig(auth_token_file=str(path))
    for mode in (0o644, 0o640, 0o604, 0o620, 0o602):
        path.chmod(mode)
        with pytest.raises(ConfigError) as refused:
            TransportSecurity.from_common(config, {})
        assert str(refused.value) == (
            f"auth_token_file {str(path)!r}: readable or writable by group or others (mode "
            f"{mode:04o}); a job token file must be readable by its owner only (chmod 600 "
            f"{path}), or pass --insecure-token ({ENV_INSECURE_TOKEN}=1) to accept it")
        assert TransportSecurity.from_common(config, {ENV_INSECURE_TOKEN: "1"}).token
    path.chmod(0o600)
    assert TransportSecurity.from_common(config, {}).token
    path.chmod(0o400)
    assert TransportSecurity.from_common(config, {}).token

    from persia_py.wire import security

    def status(uid: int, mode: int):
        return os.stat_result((0o100000 | mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))

    # Seen by a user (uid 1000) that is not root: a file of root's may be group-readable
    # (Kubernetes mounts a Secret so: root's, group fsGroup, 0440); another user's never.
    monkeypatch.setattr(security.os, "geteuid", lambda: 1000)
    assert security.token_file_problem(status(0, 0o440)) is None
    assert security.token_file_problem(status(1000, 0o400)) is None
    assert "mode 0460" in security.token_file_problem(status(0, 0o460))
    assert "mode 0444" in security.token_file_problem(status(0, 0o444))
    assert "mode 0440" in security.token_file_problem(status(1000, 0o440))
    assert security.token_file_problem(status(1001, 0o400)) == (
        "owned by uid 1001, neither this user (uid 1000) nor root")


def test_tls_config_needs_all_three_existing_files(tmp_path) -> None:
    tls = make_tls_files(tmp_path)
    with pytest.raises(ConfigError, match="common_config.tls_cert_file: TLS needs all of"):
        global_config_from_dict({"common_config": {"tls_cert_file": tls["tls_cert_file"]}})
    with pytest.raises(ConfigError, match="tls_ca_file: .*missing.pem' is not a readable file"):
        CommonConfig(**dict(tls, tls_ca_file=str(tmp_path / "missing.pem")))
    assert TransportSecurity.from_common(CommonConfig(**tls), {}).tls


def test_servers_bind_loopback_by_default_and_take_no_token_flag() -> None:
    parser = build_parser()
    for role in ("embedding-parameter-server", "embedding-worker"):
        assert parser.parse_args([role]).bind == "127.0.0.1"
    local = parser.parse_args(["local", "--nn-worker", "t.py", "--data-loader", "d.py",
                               "--embedding-config", "e.yml"])
    assert local.bind == "127.0.0.1"
    # --insecure-token is a switch; no flag takes a token (it would leak via ps).
    flags = [opt for action in parser._subparsers._group_actions[0].choices.values()
             for a in action._actions if a.nargs != 0 for opt in a.option_strings]
    assert not [f for f in flags if "token" in f], "a token on the command line leaks via ps"
