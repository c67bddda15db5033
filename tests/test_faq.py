"""docs/faq.md tells the truth: every error it lists is raised, by the call its entry
describes, with exactly the listed text and type. ``<name>`` in a listed message is a
placeholder: each trigger below says what it stands for in its case, the filled-in text
must equal the message character for character, and a placeholder the trigger does not
fill (or fills but the page lacks) fails the test. An entry without a trigger, or a
trigger without an entry, fails too."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from checkout import ROOT
from role_processes import start_server

from persia_py.config import (
    CheckpointConfig,
    CommonConfig,
    GlobalConfig,
    ParameterServerConfig,
    load_embedding_config,
    load_global_config,
)
from persia_py.ctx import DataCtx, InferCtx, TrainCtx, eval_ctx
from persia_py.data import DataLoader, IterableDataset, StreamingDataset
from persia_py.embedding import EmbeddingConfig
from persia_py.embedding.data import (
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)
from persia_py.embedding.optim import SGD, Adagrad
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


def model() -> torch.nn.Module:
    return torch.nn.Linear(6, 1)


def single(slot: str, ids) -> IDTypeFeatureWithSingleID:
    return IDTypeFeatureWithSingleID(slot, np.asarray(ids, dtype=np.uint64))


def batch(slots=("user", "item"), requires_grad: bool = True) -> PersiaBatch:
    return PersiaBatch([single(s, [1, 2]) for s in slots],
                       non_id_type_features=[NonIDTypeFeature(np.zeros((2, 2), np.float32))],
                       labels=[Label(np.zeros((2, 1), np.float32))],
                       requires_grad=requires_grad)


def train_ctx(cluster: Cluster | None = None, **kwargs) -> TrainCtx:
    m = kwargs.pop("model", None) or model()
    params = (m if isinstance(m, torch.nn.Module) else model()).parameters()
    args = dict(model=m, embedding_optimizer=SGD(lr=0.1),
                dense_optimizer=torch.optim.SGD(params, lr=0.1), global_config=GLOBAL,
                env=PersiaEnv(embedding_worker_addrs=(cluster.embedding_worker,) if cluster
                              else ()))
    return TrainCtx(**{**args, **kwargs})


def raised(call: Callable[[], object]) -> BaseException:
    """The exception ``call`` raises; fails the test if it returns."""
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - SystemExit is one of the listed errors
        return exc
    raise AssertionError("no error was raised")


COMMON = CommonConfig(rpc_timeout_sec=30, startup_timeout_sec=60)
GLOBAL = GlobalConfig(common_config=COMMON)
EMBEDDING_CONFIG = "slots_config:\n  user:\n    dim: 2\n  item:\n    dim: 2\n"


@dataclass(frozen=True)
class Cluster:
    embedding_worker: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A parameter server and an embedding worker serving slots ``user`` and ``item``."""
    root = tmp_path_factory.mktemp("faq")
    (root / "embedding_config.yml").write_text(EMBEDDING_CONFIG)
    config = ["--embedding-config", str(root / "embedding_config.yml")]
    ps, ps_port = start_server("embedding-parameter-server", *config)
    try:
        ew, ew_port = start_server("embedding-worker", *config,
                                   "--ps-addrs", f"127.0.0.1:{ps_port}")
        try:
            yield Cluster(f"127.0.0.1:{ew_port}")
        finally:
            ew.stop()
    finally:
        ps.stop()


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


class Empty(IterableDataset):
    def __iter__(self):
        return iter(())


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


# -- the checks behind the entries, on every argument ------------------------------------------

WRONG_TYPES = [  # (call, the start of its message)
    (lambda: train_ctx(mixed_precision="yes"), "TrainCtx(mixed_precision=...): expected a bool"),
    (lambda: train_ctx(embedding_config={"seed": 1}), "TrainCtx(embedding_config=...): expected "
     "a persia_py.embedding.EmbeddingConfig"),
    (lambda: train_ctx(distributed_option="ddp"), "TrainCtx(distributed_option=...): expected "
     "a persia_py.distributed.DDPOption or FSDPOption"),
    (lambda: train_ctx(device_id="cuda:0"), "TrainCtx(device_id=...): expected an int"),
    (lambda: train_ctx(grad_clip_norm="1"), "TrainCtx(grad_clip_norm=...): expected a finite "
     "number > 0 or None"),
    (lambda: train_ctx(grad_accumulation_steps=2.5), "TrainCtx(grad_accumulation_steps=...): "
     "expected an int >= 1"),
    (lambda: train_ctx(env="x"), "TrainCtx(env=...): expected a persia_py.env.PersiaEnv"),
    (lambda: train_ctx(global_config={}), "TrainCtx(global_config=...): expected a "
     "persia_py.config.GlobalConfig"),
    (lambda: InferCtx("127.0.0.1:9"), "InferCtx(embedding_worker_address_list=...): expected "
     "a list of 'host:port' addresses"),
    (lambda: InferCtx(embedding_worker_addresses=[9]), "InferCtx(embedding_worker_addresses="
     "...)[0]: expected a 'host:port' address"),
    (lambda: DataCtx(buffer_size="3"), "DataCtx(buffer_size=...): expected an int >= 1"),
    (lambda: DataCtx(port="9"), "DataCtx(port=...): expected an int"),
    (lambda: DataCtx(env={}), "DataCtx(env=...): expected a persia_py.env.PersiaEnv"),
    (lambda: DataCtx(global_config={}), "DataCtx(global_config=...): expected a "
     "persia_py.config.GlobalConfig"),
    (lambda: InferCtx(model="m"), "InferCtx(model=...): expected a torch.nn.Module"),
    (lambda: eval_ctx("m").__enter__(), "eval_ctx(model=...): expected a torch.nn.Module"),
    (lambda: StreamingDataset(buffer_size="8"), "StreamingDataset(buffer_size=...): expected "
     "an int >= 1"),
    (lambda: Empty(buffer_size=2.5), "Empty(buffer_size=...): expected an int >= 1"),
    (lambda: PersiaBatch(single("user", [1])), "PersiaBatch(id_type_features=...): expected "
     "a list of IDTypeFeature"),
    (lambda: PersiaBatch([np.ones(1, np.uint64)]), "PersiaBatch(id_type_features=...)[0]: "
     "expected an IDTypeFeature or IDTypeFeatureWithSingleID"),
    (lambda: PersiaBatch([single("user", [1])], labels=Label(np.zeros((1, 1)))),
     "PersiaBatch(labels=...): expected a list or None"),
    (lambda: PersiaBatch([single("user", [1])], meta="x"), "PersiaBatch(meta=...): expected "
     "bytes or None"),
    (lambda: PersiaBatch([single("user", [1])], non_id_type_features=[Label(np.zeros((1, 1)))]),
     "non_id_type_feature: expected a NonIDTypeFeature or a numpy array"),
    (lambda: PersiaBatch([single("user", [1])], labels=[[0.0]]),
     "label: expected a Label or a numpy array"),
    (lambda: IDTypeFeature(7, []), "IDTypeFeature(name=...): expected the slot's name, a str"),
    (lambda: Label(torch.zeros(1)), "Label(data=...): expected a numpy array"),
    (lambda: SGD(lr=None), "lr: expected a number"),
    (lambda: EmbeddingConfig(seed="0"), "seed: expected an int"),
    (lambda: EmbeddingConfig(emb_initialization=0.01), "emb_initialization: expected (lower, "
     "upper)"),
    (lambda: EmbeddingConfig(weight_bound="10"), "weight_bound: expected a number"),
]


@pytest.mark.parametrize("call, start", WRONG_TYPES, ids=[s.split(":")[0] for _, s in WRONG_TYPES])
def test_a_wrong_argument_type_is_a_type_error_naming_the_argument(call, start: str) -> None:
    exc = raised(call)
    assert isinstance(exc, TypeError), repr(exc)
    assert str(exc).startswith(start), str(exc)


OUT_OF_RANGE = [  # (call, the start of its message): the right type, a wrong value
    (lambda: DataCtx(buffer_size=0), "DataCtx(buffer_size=...): expected an int >= 1, got 0"),
    (lambda: DataCtx(port=-1), "DataCtx(port=...): expected 0 <= port <= 65535"),
    (lambda: train_ctx(grad_clip_norm=0), "TrainCtx(grad_clip_norm=...): expected a finite "
     "number > 0"),
    (lambda: train_ctx(grad_accumulation_steps=0), "TrainCtx(grad_accumulation_steps=...): "
     "expected an int >= 1"),
]


@pytest.mark.parametrize("call, start", OUT_OF_RANGE,
                         ids=[s.split(":")[0] for _, s in OUT_OF_RANGE])
def test_a_value_out_of_range_is_a_value_error_not_a_type_error(call, start: str) -> None:
    exc = raised(call)
    assert type(exc) is ValueError, repr(exc)
    assert str(exc).startswith(start), str(exc)


@pytest.mark.processes
def test_a_context_refuses_use_after_its_with_block(cluster) -> None:
    with train_ctx(cluster) as ctx:
        loader = DataLoader(Empty())
        assert list(loader) == []  # usable inside
    assert str(raised(lambda: iter(loader))) == (
        "a DataLoader is used outside its context; use it inside `with TrainCtx(...) as ctx:`")
    assert str(raised(lambda: ctx.backward(torch.zeros(())))) == (
        "ctx.backward is used outside its context; use it inside `with TrainCtx(...) as ctx:`")
    with train_ctx(cluster) as outer, eval_ctx(outer.model) as evaluation:
        pass
    assert str(raised(lambda: evaluation.prepare(batch(requires_grad=False)))) == (
        "ctx.prepare is used outside its context; use it inside `with eval_ctx(model) as ctx:`")
