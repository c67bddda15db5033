"""The checks behind docs/faq.md's entries, on every argument of the public API's
constructors: a wrong type is a ``TypeError`` that names the argument and what to pass,
the right type with a wrong value a ``ValueError``, and a context's objects refuse use
after its ``with`` block. (:mod:`test_faq_errors` checks each listed message's text.)"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from api_calls import Cluster, Empty, batch, raised, serving_cluster, single, train_ctx

from persia_py.ctx import DataCtx, InferCtx, eval_ctx
from persia_py.data import DataLoader, StreamingDataset
from persia_py.embedding import EmbeddingConfig
from persia_py.embedding.data import IDTypeFeature, Label, PersiaBatch
from persia_py.embedding.optim import SGD


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """For the contexts whose use after ``with`` is checked (:func:`api_calls.serving_cluster`)."""
    with serving_cluster(tmp_path_factory.mktemp("api-checks")) as running:
        yield running


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
