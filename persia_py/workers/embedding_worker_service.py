"""The embedding worker's gRPC face, and the client NN workers and data loaders use."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import numpy as np

from persia_py.checkpoint import rewind
from persia_py.proto import common_pb2, embedding_worker_pb2_grpc
from persia_py.proto import embedding_worker_pb2 as pb
from persia_py.wire import codec
from persia_py.wire import raw_methods as wire_rpc
from persia_py.wire.rpc import ServiceClient, create_server, grpc_method
from persia_py.workers.slots import SlotIds, SlotRows

if TYPE_CHECKING:  # the servicer's; a client does not import the worker
    from persia_py.workers.embedding_worker import EmbeddingWorker

logger = logging.getLogger(__name__)


def _features(request_features, worker: EmbeddingWorker) -> list[SlotIds]:
    """Decode a batch's ID features; refuse one whose lookup answer could not be sent.

    The bound assumes every id distinct: rows ``dim`` floats plus an int64 index per id,
    times the hash-stacking rounds.
    """
    features = [
        SlotIds(*codec.decode_id_feature(f, f"features[{i}]"))
        for i, f in enumerate(request_features)
    ]
    slots = worker.embedding_config.slots_config
    answer_bytes = sum(f.ids.size * slots[f.slot].hash_stack_config.rounds
                       * (4 * slots[f.slot].dim + 8) + 4 * f.lengths.size
                       for f in features if f.slot in slots)
    limit = worker.global_config.common_config.max_message_bytes
    if answer_bytes > limit:
        raise ValueError(f"the batch's lookup answer could reach {answer_bytes} bytes, over "
                         f"max_message_bytes {limit}; send smaller batches")
    return features


def _encode_rows(rows: list[SlotRows], wire: pb.WireOptions) -> bytes:
    """A serialized LookupBatchResponse; rows travel as the parameter servers sent them
    (float16 with their ``embedding_fp16``) or narrowed to float16 for ``wire.fp16``."""
    pieces = []
    for r in rows:
        pieces += codec.message_field(1, [  # LookupBatchResponse.slots
            pb.SlotEmbedding(slot=r.slot, pooling=r.pooling, sqrt_scaling=r.sqrt_scaling,
                             sample_fixed_size=r.sample_fixed_size,
                             hash_stack_rounds=r.hash_stack_rounds).SerializeToString(),
            *codec.tensor_field(2, r.rows, fp16=wire.fp16, compress=wire.lz4),
            *codec.tensor_field(3, r.index, compress=wire.lz4),
            *codec.tensor_field(4, r.lengths),
        ])
    return codec.join(pieces)


def _decode_rows(response: pb.LookupBatchResponse) -> list[SlotRows]:
    out = []
    for i, s in enumerate(response.slots):
        out.append(SlotRows(
            slot=s.slot,
            rows=codec.decode(s.rows, name=f"slots[{i}].rows", ndim=2, as_float32=True),
            index=codec.decode(s.index, name=f"slots[{i}].index", dtypes=("int64",), ndim=1),
            lengths=codec.decode(s.lengths, name=f"slots[{i}].lengths", dtypes=("int32",), ndim=1),
            pooling=s.pooling, sqrt_scaling=s.sqrt_scaling, sample_fixed_size=s.sample_fixed_size,
            hash_stack_rounds=max(1, s.hash_stack_rounds),
        ))
    return out


class EmbeddingWorkerServicer(embedding_worker_pb2_grpc.EmbeddingWorkerServicer):
    def __init__(self, worker: EmbeddingWorker) -> None:
        self.worker = worker

    @grpc_method
    def Configure(self, request, context):
        self.worker.configure(request)
        return common_pb2.ConfigureResponse()

    @grpc_method
    def PutBatch(self, request, context):
        identity = (request.stream, request.batch_id) if request.stream else None
        ref = self.worker.put_batch(_features(request.features, self.worker), request.batch_size,
                                    request.requires_grad, identity=identity)
        return pb.PutBatchResponse(ref=ref)

    @grpc_method
    def Lookup(self, request, context):
        return _encode_rows(self.worker.lookup(request.ref), request.wire)

    @grpc_method
    def LookupDirect(self, request, context):
        return _encode_rows(self.worker.lookup_direct(_features(request.features, self.worker),
                                                      request.batch_size), request.wire)

    @grpc_method
    def UpdateGradients(self, request, context):
        grads = {}
        for i, s in enumerate(request.slots):
            if s.slot in grads:
                raise ValueError(f"slot {s.slot!r} appears twice")
            # Kept in the precision they arrived in, as views of the request: this worker
            # only routes them (the parameter servers widen to float32 before the step).
            grads[s.slot] = codec.decode(s.grads, name=f"slots[{i}].grads",
                                         dtypes=("float16", "float32"), ndim=2, copy=False)
        return pb.UpdateGradientsResponse(num_updated=self.worker.update_gradients(
            request.ref, grads, rerouted=request.rerouted))

    @grpc_method
    def Health(self, request, context):
        return common_pb2.HealthResponse(role="embedding-worker", configured=self.worker.configured,
                                         instance=rewind.INSTANCE)

    @grpc_method
    def Restart(self, request, context):
        """Exit, to come back empty: a restarted training rewinds (persia_py/checkpoint/rewind.py)."""
        logger.warning("embedding worker: asked to restart (%s)", request.reason[:200])
        rewind.exit_after_answer(context, "embedding worker")
        return common_pb2.RestartResponse(instance=rewind.INSTANCE)


def create_embedding_worker_server(worker: EmbeddingWorker, address: str) -> tuple[grpc.Server, int]:
    """A started gRPC server for ``worker`` on ``address``; returns (server, port)."""
    server, port = create_server(address, worker.global_config.common_config, max_workers=32)
    # Big messages skip protobuf's copies (persia_py.wire.raw_methods).
    wire_rpc.add_servicer(
        embedding_worker_pb2_grpc.add_EmbeddingWorkerServicer_to_server,
        EmbeddingWorkerServicer(worker), server,
        parsed_requests={"PutBatch": pb.PutBatchRequest, "LookupDirect": pb.LookupDirectRequest,
                         "UpdateGradients": pb.UpdateGradientsRequest},
        bytes_answers=("Lookup", "LookupDirect"),
    )
    server.start()
    return server, port


class EmbeddingWorkerClient(ServiceClient):
    """Client of one embedding worker."""

    service_name = "embedding worker"
    stub_class = embedding_worker_pb2_grpc.EmbeddingWorkerStub
    _service = pb.DESCRIPTOR.services_by_name["EmbeddingWorker"]
    wire_methods = {
        "_put_batch": (_service, "PutBatch", pb.PutBatchResponse, False),
        "_lookup": (_service, "Lookup", pb.LookupBatchResponse, True),
        "_lookup_direct": (_service, "LookupDirect", pb.LookupBatchResponse, True),
        "_update_gradients": (_service, "UpdateGradients", pb.UpdateGradientsResponse, False),
    }
    # Set by ServiceClient from wire_methods; each takes a message or its bytes.
    _put_batch: Callable[..., pb.PutBatchResponse]
    _lookup: Callable[..., codec.RawMessage]
    _lookup_direct: Callable[..., codec.RawMessage]
    _update_gradients: Callable[..., pb.UpdateGradientsResponse]

    def configure(self, request: common_pb2.ConfigureRequest) -> None:
        self._call(self.stub.Configure, request, idempotent=True)

    def _wire(self) -> pb.WireOptions:
        return pb.WireOptions(fp16=self.common.embedding_fp16, lz4=self.common.lz4_compression)

    def put_batch(self, features: list[tuple[str, np.ndarray, np.ndarray]], batch_size: int,
                  requires_grad: bool, *, timeout: float | None = None,
                  identity: tuple[str, int] | None = None) -> int:
        stream, batch_id = identity or ("", 0)
        pieces = [pb.PutBatchRequest(batch_size=batch_size, requires_grad=requires_grad,
                                     stream=stream, batch_id=batch_id).SerializeToString()]
        for f in features:
            pieces += codec.id_feature_field(1, *f)  # PutBatchRequest.features
        # With an identity a repeat returns the pending batch's ref: safe to retry (also
        # across a restart of the worker, which then stores it anew).
        return self._call(self._put_batch, codec.join(pieces), idempotent=identity is not None,
                          timeout=timeout).ref

    def lookup(self, ref: int) -> list[SlotRows]:
        # Safe to retry: a lookup that failed leaves the batch unclaimed.
        request = pb.LookupBatchRequest(ref=ref, wire=self._wire())
        return _decode_rows(self._call(self._lookup, request, idempotent=True))

    def lookup_direct(self, features: list[tuple[str, np.ndarray, np.ndarray]],
                      batch_size: int) -> list[SlotRows]:
        pieces = [pb.LookupDirectRequest(batch_size=batch_size,
                                         wire=self._wire()).SerializeToString()]
        for f in features:
            pieces += codec.id_feature_field(1, *f)  # LookupDirectRequest.features
        return _decode_rows(self._call(self._lookup_direct, codec.join(pieces), idempotent=True))

    def update_gradients(self, ref: int, grads: list[tuple[str, np.ndarray]], *,
                         rerouted: bool = False) -> int:
        pieces = [pb.UpdateGradientsRequest(ref=ref, rerouted=rerouted).SerializeToString()]
        for s, g in grads:
            pieces += codec.message_field(2, [  # UpdateGradientsRequest.slots
                pb.SlotRowGradients(slot=s).SerializeToString(),
                *codec.tensor_field(2, g, fp16=self.common.embedding_fp16,
                                    compress=self.common.lz4_compression),
            ])
        request = codec.join(pieces)
        # Safe to retry: the embedding worker keeps the batch and its update's sequence
        # numbers until every parameter server acknowledged, and answers a repeat of a
        # finished ref without applying it again.
        return self._call(self._update_gradients, request, idempotent=True).num_updated
