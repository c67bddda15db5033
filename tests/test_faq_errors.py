"""docs/faq.md tells the truth: every error it lists is raised, by the call its entry
describes, with exactly the listed text and type. ``<name>`` in a listed message is a
placeholder: each trigger below says what it stands for in its case, the filled-in text
must equal the message character for character, and a placeholder the trigger does not
fill (or fills but the page lacks) fails the test. An entry without a trigger, or a
trigger without an entry, fails too."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from api_calls import COMMON, GLOBAL, Cluster, batch, model, raised, serving_cluster, train_ctx
from checkout import ROOT

from persia_py.config import (
    CheckpointConfig,
    CommonConfig,
    ParameterServerConfig,
    load_embedding_config,
    load_global_config,
)
from persia_py.ctx import DataCtx, InferCtx, TrainCtx, eval_ctx
from persia_py.data import DataLoader, StreamingDataset
from persia_py.embedding.data import (
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
    PersiaBatch,
)
from persia_py.embedding.optim import Adagrad
from persia_py.env import PersiaEnv
from persia_py.launcher.job_token import require_token
from persia_py.ops.start_checks import Written, check_checkpoint_paths, check_writable, this_user
from persia_py.wire.security import ENV_AUTH_TOKEN, TransportSecurity

FAQ = ROOT / "docs" / "faq.md"
PLACEHOLDER = re.compile(r"<([a-z_]+)>")


@dataclass(frozen=True)
class Entry:
    title: str
    kind: str
    """The exception type the page names (``TypeError``, ``grpc.RpcError``, ...)."""
    message: str


def faq_entries() -> list[Entry]:
    """The ``### `` entries of the page's Errors section: each names its exception in a
    ``Raised as `<type>``` line and gives its message in the first ``text`` block."""
    text = FAQ.read_text()
    errors = text[text.index("\n## Errors\n"):]
    entries = []
    for chunk in re.split(r"\n### ", errors)[1:]:
        title, body = chunk.split("\n", 1)
        kind = re.search(r"Raised as (?:the details of )?(?:a )?`([\w.]+)`", body)
        message = re.search(r"```text\n(.*?)\n```", body, re.S)
        assert kind and message, f"faq.md entry {title!r} lacks its 'Raised as' line or message"
        entries.append(Entry(title.strip(), kind.group(1), message.group(1)))
    return entries


# -- what the triggers need ------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The entries in ``NEEDS_SERVERS`` send to it (:func:`api_calls.serving_cluster`)."""
    with serving_cluster(tmp_path_factory.mktemp("faq")) as running:
        yield running


class Fixtures:
    """What a trigger may use; the cluster is started only for the entries that need it."""

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        self.request, self.tmp_path, self.monkeypatch = request, tmp_path, monkeypatch

    @property
    def cluster(self) -> Cluster:
        return self.request.getfixturevalue("cluster")

    def config_file(self, name: str, text: str) -> Path:
        path = self.tmp_path / name
        path.write_text(text)
        return path


def send(fx: Fixtures, made: PersiaBatch) -> BaseException:
    """What ``DataCtx.send_data(made)`` raises (out of the ``with``: a data loader that
    ends well waits for NN workers to drain its stream, one that fails does not)."""
    env = PersiaEnv(embedding_worker_addrs=(fx.cluster.embedding_worker,), nn_world_size=1)
    try:
        with DataCtx(port=0, env=env, global_config=GLOBAL) as ctx:
            ctx.send_data(made)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("send_data took the batch")


def in_training(fx: Fixtures, call: Callable[[TrainCtx], object]) -> BaseException:
    with train_ctx(fx.cluster) as ctx:
        return raised(lambda: call(ctx))


# -- one trigger per entry: (exception, placeholder values) ------------------------------------

Trigger = Callable[[Fixtures], tuple[BaseException, dict[str, str]]]


def no_job_token(fx: Fixtures):
    fx.monkeypatch.delenv(ENV_AUTH_TOKEN, raising=False)
    return raised(lambda: require_token("persia-launcher embedding-worker", None, False)), {
        "role": "embedding-worker"}


def weak_token(fx: Fixtures):
    return raised(lambda: TransportSecurity.from_common(COMMON, {ENV_AUTH_TOKEN: "short"})), {
        "source": ENV_AUTH_TOKEN, "why": "fewer than 16 characters"}


def loose_token_file(fx: Fixtures):
    path = fx.config_file("token", "f3a9c1d27be84e60a5d7c2b91e0f4a68\n")
    path.chmod(0o640)
    common = CommonConfig(auth_token_file=str(path))
    return raised(lambda: TransportSecurity.from_common(common, {})), {
        "path": str(path), "mode": "0640"}


def unknown_key(fx: Fixtures):
    path = fx.config_file("global_config.yml", "embedding_parameter_server_config:\n  capacty: 10\n")
    # The valid keys come from the schema, which may grow.
    keys = sorted(f.name for f in dataclasses.fields(ParameterServerConfig))
    return raised(lambda: load_global_config(path)), {"file": str(path), "key": "capacty",
                                                       "valid_keys": str(keys),
                                                       "closest": "capacity"}


def wrong_config_type(fx: Fixtures):
    path = fx.config_file("embedding_config.yml", "slots_config:\n  user:\n    dim: eight\n")
    return raised(lambda: load_embedding_config(path)), {"file": str(path), "slot": "user",
                                                          "value": "eight"}


def dim_out_of_range(fx: Fixtures):
    path = fx.config_file("embedding_config.yml", "slots_config:\n  user:\n    dim: 0\n")
    return raised(lambda: load_embedding_config(path)), {"file": str(path), "slot": "user",
                                                          "value": "0"}


def slot_without_dim(fx: Fixtures):
    path = fx.config_file("embedding_config.yml", "slots_config:\n  user:\n    pooling: mean\n")
    return raised(lambda: load_embedding_config(path)), {"file": str(path), "slot": "user"}


def model_of_wrong_type(fx: Fixtures):
    return raised(lambda: train_ctx(model="dlrm")), {"what": "str 'dlrm'"}


def torch_embedding_optimizer(fx: Fixtures):
    m = model()
    return raised(lambda: train_ctx(model=m, embedding_optimizer=torch.optim.Adagrad(
        m.parameters()))), {"what": "torch.optim.adagrad.Adagrad"}


def dense_optimizer_not_torch(fx: Fixtures):
    return raised(lambda: train_ctx(dense_optimizer=Adagrad(lr=0.1))), {
        "what": "persia_py.embedding.optim.Adagrad"}


def optimizer_setting_not_a_number(fx: Fixtures):
    return raised(lambda: Adagrad(lr="0.1")), {"setting": "lr", "value": "'0.1'"}


def outside_with(fx: Fixtures):
    ctx = train_ctx()  # made, never entered
    return raised(lambda: ctx.backward(torch.zeros(()))), {"call": "ctx.backward"}


def data_ctx() -> DataCtx:
    """A data-loader context, made but not entered (nothing listens at its address)."""
    return DataCtx(port=0, env=PersiaEnv(embedding_worker_addrs=("127.0.0.1:9",)),
                   global_config=GLOBAL)


def data_ctx_outside_with(fx: Fixtures):
    return raised(lambda: data_ctx().send_data(batch())), {}


def send_data_of_a_tuple(fx: Fixtures):
    return raised(lambda: data_ctx().send_data((np.zeros(2), np.ones(2)))), {"what": "tuple"}


def loader_outside_context(fx: Fixtures):
    return raised(lambda: DataLoader(StreamingDataset())), {}


def loader_of_a_list(fx: Fixtures):
    return raised(lambda: DataLoader([batch()])), {"what": "list"}


def streaming_iterated(fx: Fixtures):
    return raised(lambda: iter(StreamingDataset())), {}


def streaming_outside_training(fx: Fixtures):
    def evaluate(ctx: TrainCtx) -> None:
        with eval_ctx(ctx.model):
            iter(DataLoader(StreamingDataset()))
    return in_training(fx, evaluate), {}


def raw_batch_to_forward(fx: Fixtures):
    return raised(lambda: train_ctx().forward(batch())), {}


def training_batch_to_evaluation(fx: Fixtures):
    m = model()
    with InferCtx([fx.cluster.embedding_worker], model=m, global_config=GLOBAL,
                  env=PersiaEnv()) as ctx:
        return raised(lambda: ctx.prepare(batch())), {}


def training_batch_to_prepare(fx: Fixtures):
    return raised(lambda: train_ctx().prepare(batch())), {}


def requires_grad_not_bool(fx: Fixtures):
    return raised(lambda: batch(requires_grad="yes")), {"what": "str 'yes'"}


def backward_without_forward(fx: Fixtures):
    return in_training(fx, lambda ctx: ctx.backward(torch.zeros(()))), {}


def flat_array_to_id_feature(fx: Fixtures):
    ids = np.arange(4, dtype=np.uint64)
    return raised(lambda: IDTypeFeature("user", ids)), {"slot": "user",
                                                         "what": "numpy.ndarray of uint64"}


def negative_ids(fx: Fixtures):
    return raised(lambda: IDTypeFeatureWithSingleID("user", np.array([3, -1, -7]))), {
        "slot": "user", "value": "-1", "position": "1", "count": "2"}


def tensor_as_dense_feature(fx: Fixtures):
    return raised(lambda: NonIDTypeFeature(torch.zeros(2, 2))), {"what": "torch.Tensor"}


def unknown_slot(fx: Fixtures):
    return send(fx, batch(slots=("user", "usr"))), {"slot": "usr", "slots": "['item', 'user']"}


def missing_slot(fx: Fixtures):
    return send(fx, batch(slots=("user",))), {"slots": "['item']"}


def restart_without_checkpoint(fx: Fixtures):
    from persia_py.checkpoint.rewind import ENV_RESTART_COUNT, rewind_after_restart

    fx.monkeypatch.setenv(ENV_RESTART_COUNT, "2")
    return raised(lambda: rewind_after_restart(
        periodic_dir=str(fx.tmp_path), loaders=[], embedding_workers=[],
        common=CommonConfig(), rank=0)), {"count": "2"}


def replay_without_update_log(fx: Fixtures):
    from persia_py.launcher import roles
    from persia_py.launcher.cli import build_parser
    from persia_py.launcher.role_options import role_options_from_flags

    config = str(ROOT / "examples" / "criteo_synthetic" / "embedding_config.yml")
    args = build_parser().parse_args(["embedding-parameter-server", "--embedding-config",
                                      config, "--replay-update-log"])
    return raised(lambda: roles.run_parameter_server(role_options_from_flags(args))), {}


def folder_not_writable(fx: Fixtures) -> tuple[BaseException, dict[str, str]]:
    # Root writes anywhere but through a file (tests/test_start_checks.py makes a folder
    # read-only for a role's process).
    (fx.tmp_path / "a-file").write_text("")
    folder = fx.tmp_path / "a-file" / "inc"
    exc = raised(lambda: check_writable([Written(folder, "checkpoint_config.incremental_dir")]))
    return exc, {"key": "checkpoint_config.incremental_dir", "folder": str(folder),
                 "user": this_user(), "why": f"'{fx.tmp_path}/a-file' is a file, not a folder"}


TRIGGERS: dict[str, Trigger] = {
    "No job token": no_job_token,
    "Job token too weak": weak_token,
    "Job token file others can read": loose_token_file,
    "Unknown config key": unknown_key,
    "Wrong type in a config file": wrong_config_type,
    "Embedding dim out of range": dim_out_of_range,
    "Slot without a dim": slot_without_dim,
    "Model of the wrong type": model_of_wrong_type,
    "Embedding optimizer from torch": torch_embedding_optimizer,
    "Dense optimizer not from torch": dense_optimizer_not_torch,
    "Optimizer setting not a number": optimizer_setting_not_a_number,
    "Context used outside its with block": outside_with,
    "DataCtx used outside its with block": data_ctx_outside_with,
    "send_data given something that is not a batch": send_data_of_a_tuple,
    "DataLoader made outside a context": loader_outside_context,
    "DataLoader given something that is not a dataset": loader_of_a_list,
    "StreamingDataset iterated directly": streaming_iterated,
    "StreamingDataset outside training": streaming_outside_training,
    "Raw PersiaBatch passed to forward": raw_batch_to_forward,
    "Training batch in an evaluation context": training_batch_to_evaluation,
    "Training batch passed to TrainCtx.prepare": training_batch_to_prepare,
    "requires_grad not a bool": requires_grad_not_bool,
    "backward without forward": backward_without_forward,
    "One flat array given to IDTypeFeature": flat_array_to_id_feature,
    "Negative ids": negative_ids,
    "Tensor given as a dense feature": tensor_as_dense_feature,
    "Slot not in the embedding config": unknown_slot,
    "Batch missing a slot": missing_slot,
    "NN ranks restarted before the first checkpoint": restart_without_checkpoint,
    "Checkpoint folder outside the checkpoint root": lambda fx: (raised(
        lambda: check_checkpoint_paths(CheckpointConfig(root=str(fx.tmp_path), dir="/data/x"))),
        {"value": "/data/x", "root": str(fx.tmp_path.resolve()), "where": "checkpoint_config.root"}),
    "Folder the job cannot write": folder_not_writable,
    "Stop on signal without a checkpoint folder":
        lambda fx: (raised(lambda: train_ctx(stop_on_signal=True)), {}),
    "Update log replay without a log folder": replay_without_update_log,
}
NEEDS_SERVERS = {"StreamingDataset outside training", "Training batch in an evaluation context",
                 "backward without forward", "Slot not in the embedding config",
                 "Batch missing a slot"}
STARTS_PROCESSES = {"Update log replay without a log folder"}  # the server's start-up does


def test_every_entry_has_a_trigger_and_every_trigger_an_entry() -> None:
    titles = [e.title for e in faq_entries()]
    assert len(titles) == len(set(titles)), "two faq.md entries share a title"
    assert set(titles) == set(TRIGGERS), (sorted(set(titles) - set(TRIGGERS)),
                                          sorted(set(TRIGGERS) - set(titles)))


def _params():
    return [pytest.param(e, id=e.title, marks=[pytest.mark.processes]
                         if e.title in NEEDS_SERVERS | STARTS_PROCESSES else [])
            for e in faq_entries() if e.title in TRIGGERS]


@pytest.mark.parametrize("entry", _params())
def test_the_listed_error_is_raised_with_exactly_its_text(entry: Entry, request, tmp_path,
                                                          monkeypatch) -> None:
    exc, values = TRIGGERS[entry.title](Fixtures(request, tmp_path, monkeypatch))
    placeholders = set(PLACEHOLDER.findall(entry.message))
    assert placeholders == set(values), (placeholders, set(values))
    expected = PLACEHOLDER.sub(lambda m: values[m.group(1)], entry.message)
    message = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
    assert message == expected
    kinds = {c.__name__ for c in type(exc).__mro__}
    assert entry.kind.rsplit(".", 1)[-1] in kinds, (entry.kind, type(exc).__mro__)

