"""The embedding worker's gRPC face, and the client NN workers and data loaders use."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import numpy as np

from persia_py.checkpoint import rewind
from persia_py.config import CommonConfig
from persia_py.proto import common_pb2, embedding_worker_pb2_grpc
from persia_py.proto import embedding_worker_pb2 as pb
from persia_py.wire import codec, shm
from persia_py.wire import raw_methods as wire_rpc
from persia_py.wire.rpc import ServiceClient, create_server, grpc_method
from persia_py.wire.shm_calls import MappedSegments, SegmentLender, TensorData, segment_message
from persia_py.workers.slots import SlotIds, SlotRows, pooled_by_kernel

if TYPE_CHECKING:  # the servicer's; a client does not import the worker
    from persia_py.workers.embedding_worker import EmbeddingWorker

logger = logging.getLogger(__name__)

def _features(request_features) -> list[SlotIds]:
    """A batch's ID features, decoded (the worker checks them, and its answer's size)."""
    return [SlotIds(*codec.decode_id_feature(f, f"features[{i}]"))
            for i, f in enumerate(request_features)]


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


def _answer_specs(rows: list[SlotRows], wire: pb.WireOptions) -> list[tuple[str, tuple]]:
    """(wire dtype, shape) of each slot's rows, index and lengths, as :func:`_encode_rows`
    would send them (lz4 aside: arrays in shared memory are not compressed)."""
    specs = []
    for r in rows:
        narrow = wire.fp16 and r.rows.dtype.kind == "f"
        specs += [("float16" if narrow else r.rows.dtype.name, r.rows.shape),
                  (r.index.dtype.name, r.index.shape), (r.lengths.dtype.name, r.lengths.shape)]
    return specs


def _encode_rows_in(rows: list[SlotRows], wire: pb.WireOptions,
                    segment: shm.Segment) -> bytes | None:
    """The answer with its arrays written into ``segment`` (one copy, as :func:`codec.join`
    makes), or None if they do not fit."""
    specs = _answer_specs(rows, wire)
    offsets, size = shm.layout(specs)
    if size > segment.size:
        return None
    slots = []
    for i, r in enumerate(rows):
        tensors = []
        for k, source in enumerate((r.rows, r.index, r.lengths)):
            dtype_name, shape = specs[3 * i + k]
            out = segment.array(offsets[3 * i + k], dtype_name, shape)
            if source.dtype.name != dtype_name:
                codec.cast_float(source, dtype_name, out=out)
            else:
                np.copyto(out, source)
            tensors.append(common_pb2.Tensor(dtype=dtype_name, shape=shape))
        slots.append(pb.SlotEmbedding(
            slot=r.slot, pooling=r.pooling, sqrt_scaling=r.sqrt_scaling,
            sample_fixed_size=r.sample_fixed_size, hash_stack_rounds=r.hash_stack_rounds,
            rows=tensors[0], index=tensors[1], lengths=tensors[2],
            shm_offsets=offsets[3 * i:3 * i + 3]))
    return pb.LookupBatchResponse(slots=slots,
                                  shm=common_pb2.ShmUse(used=True)).SerializeToString()


def _decode_rows(response: pb.LookupBatchResponse,
                 in_segment: TensorData | None = None) -> list[SlotRows]:
    """The answer's slots; with ``in_segment``, their arrays are read (copied) from the
    shared-memory segment it reads. float16 rows are widened to float32 but where the NN
    worker pools them as they are (:func:`pooled_by_kernel`)."""
    out = []
    for i, s in enumerate(response.slots):
        data: list = [None, None, None]
        if in_segment is not None:
            if len(s.shm_offsets) != 3:
                raise codec.CodecError(f"slots[{i}]: {len(s.shm_offsets)} shared-memory "
                                       "offsets, expected 3 (rows, index, lengths)")
            data = [in_segment(t, o)
                    for t, o in zip((s.rows, s.index, s.lengths), s.shm_offsets)]
        index = codec.decode(s.index, name=f"slots[{i}].index", dtypes=("int64",), ndim=1,
                             data=data[1])
        lengths = codec.decode(s.lengths, name=f"slots[{i}].lengths", dtypes=("int32",),
                               ndim=1, data=data[2])
        widen = not pooled_by_kernel(s.pooling, index.shape[0], lengths.shape[0])
        out.append(SlotRows(
            slot=s.slot,
            rows=codec.decode(s.rows, name=f"slots[{i}].rows", ndim=2, as_float32=widen,
                              data=data[0]),
            index=index,
            lengths=lengths,
            pooling=s.pooling, sqrt_scaling=s.sqrt_scaling, sample_fixed_size=s.sample_fixed_size,
            hash_stack_rounds=max(1, s.hash_stack_rounds),
        ))
    return out


class EmbeddingWorkerServicer(embedding_worker_pb2_grpc.EmbeddingWorkerServicer):
    def __init__(self, worker: EmbeddingWorker) -> None:
        self.worker = worker
        self.segments = MappedSegments(worker.global_config.common_config)
        """NN workers' shared-memory segments mapped here."""
        self.num_shm_answers = 0
        """Lookup answers written into shared memory (for metrics and tests)."""
        self.num_shm_updates = 0
        """Gradient updates read from shared memory."""

    @grpc_method
    def Configure(self, request: common_pb2.ConfigureRequest, context: grpc.ServicerContext
                  ) -> common_pb2.ConfigureResponse:
        self.worker.configure(request)
        return common_pb2.ConfigureResponse()

    @grpc_method
    def PutBatch(self, request: codec.RawMessage, context: grpc.ServicerContext) -> pb.PutBatchResponse:
        # request: a parsed pb.PutBatchRequest (create_embedding_worker_server)
        identity = (request.stream, request.batch_id) if request.stream else None
        ref = self.worker.put_batch(_features(request.features), request.batch_size,
                                    request.requires_grad, identity=identity)
        return pb.PutBatchResponse(ref=ref)

    @grpc_method
    def Lookup(self, request: pb.LookupBatchRequest, context: grpc.ServicerContext) -> bytes:
        self.segments.forget(request.forget_segments)
        segment, refused = self.segments.offered(request.answer_segment)
        rows = self.worker.lookup(request.ref)
        if segment is not None:
            answer = _encode_rows_in(rows, request.wire, segment)
            if answer is not None:
                self.num_shm_answers += 1
                if self.num_shm_answers == 1:
                    logger.info("embedding worker: lookup answers go through shared memory "
                                "(an NN worker on this host)")
                return answer
            needed = shm.layout(_answer_specs(rows, request.wire))[1]
            use = common_pb2.ShmUse(refused=f"the answer needs {needed} bytes of segment, it "
                                    f"has {segment.size}", needed_bytes=needed)
        elif refused:
            use = common_pb2.ShmUse(refused=refused)
        else:
            return _encode_rows(rows, request.wire)
        return codec.join([_encode_rows(rows, request.wire),
                           *codec.message_field(2, [use.SerializeToString()])])

    @grpc_method
    def LookupDirect(self, request: codec.RawMessage, context: grpc.ServicerContext) -> bytes:
        # request: a parsed pb.LookupDirectRequest (create_embedding_worker_server)
        return _encode_rows(self.worker.lookup_direct(_features(request.features),
                                                      request.batch_size), request.wire)

    @grpc_method
    def UpdateGradients(self, request: codec.RawMessage, context: grpc.ServicerContext
                        ) -> pb.UpdateGradientsResponse:
        # request: a parsed pb.UpdateGradientsRequest (create_embedding_worker_server)
        self.segments.forget(request.forget_segments)
        segment, refused = self.segments.offered(request.grads_segment)
        if refused:  # nothing applied: the caller sends them again
            return pb.UpdateGradientsResponse(shm=common_pb2.ShmUse(refused=refused))
        grads = {}
        for i, s in enumerate(request.slots):
            if s.slot in grads:
                raise ValueError(f"slot {s.slot!r} appears twice")
            # Kept in the precision they arrived in, as views of the request (or of the
            # segment, which the NN worker does not touch until this call is answered):
            # this worker only routes them (the parameter servers widen to float32).
            data = None if segment is None else segment.tensor_data(s.grads, s.shm_offset)
            grads[s.slot] = codec.decode(s.grads, name=f"slots[{i}].grads",
                                         dtypes=("float16", "float32"), ndim=2, copy=False,
                                         data=data)
        answer = pb.UpdateGradientsResponse(num_updated=self.worker.update_gradients(
            request.ref, grads, rerouted=request.rerouted))
        if segment is not None:
            answer.shm.used = True
            self.num_shm_updates += 1
            if self.num_shm_updates == 1:
                logger.info("embedding worker: gradients come through shared memory "
                            "(an NN worker on this host)")
        return answer

    @grpc_method
    def Health(self, request: common_pb2.HealthRequest, context: grpc.ServicerContext
               ) -> common_pb2.HealthResponse:
        return common_pb2.HealthResponse(role="embedding-worker", configured=self.worker.configured,
                                         instance=rewind.INSTANCE)

    @grpc_method
    def Restart(self, request: common_pb2.RestartRequest, context: grpc.ServicerContext
                ) -> common_pb2.RestartResponse:
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

    def __init__(self, address: str, common: CommonConfig) -> None:
        super().__init__(address, common)
        # Lent one call at a time: lookups in flight and gradient sends in flight bound
        # how many exist.
        self.segments = SegmentLender(common, f"embedding worker {address}")

    @property
    def num_shm_lookups(self) -> int:
        """Lookup answers read from shared memory (for metrics and tests)."""
        return self.segments.num_answers

    @property
    def num_shm_updates(self) -> int:
        """Gradient updates sent through shared memory."""
        return self.segments.num_sends

    def close(self) -> None:
        self.segments.close()
        super().close()

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
        def request(segment: shm.Descriptor | None,
                    forget: list[shm.Descriptor]) -> pb.LookupBatchRequest:
            return pb.LookupBatchRequest(
                ref=ref, wire=self._wire(),
                answer_segment=None if segment is None else segment_message(segment),
                forget_segments=[segment_message(d) for d in forget])

        return self.segments.call_for_answer(  # decoding copies the arrays out
            request, lambda method, r: self._call(method, r, idempotent=True), self._lookup,
            _decode_rows)

    def lookup_direct(self, features: list[tuple[str, np.ndarray, np.ndarray]],
                      batch_size: int) -> list[SlotRows]:
        pieces = [pb.LookupDirectRequest(batch_size=batch_size,
                                         wire=self._wire()).SerializeToString()]
        for f in features:
            pieces += codec.id_feature_field(1, *f)  # LookupDirectRequest.features
        return _decode_rows(self._call(self._lookup_direct, codec.join(pieces), idempotent=True))

    def update_gradients(self, ref: int, grads: list[tuple[str, np.ndarray]], *,
                         rerouted: bool = False) -> int:
        # Safe to retry: the embedding worker keeps the batch and its update's sequence
        # numbers until every parameter server acknowledged, and answers a repeat of a
        # finished ref without applying it again.
        arrays = [np.asarray(g) for _, g in grads]
        dtypes = [self._wire_dtype(g) for g in arrays]

        def in_segment(segment: shm.Descriptor, forget: list[shm.Descriptor],
                       offsets: list[int]) -> pb.UpdateGradientsRequest:
            return pb.UpdateGradientsRequest(
                ref=ref, rerouted=rerouted, grads_segment=segment_message(segment),
                forget_segments=[segment_message(d) for d in forget],
                slots=[pb.SlotRowGradients(slot=slot, shm_offset=offset,
                                           grads=common_pb2.Tensor(dtype=d, shape=g.shape))
                       for (slot, _), g, d, offset in zip(grads, arrays, dtypes, offsets)])

        answer = self.segments.call_with_arrays(
            arrays, dtypes, in_segment, lambda method, r: self._call(method, r, idempotent=True),
            self._update_gradients)
        if answer is not None:
            return answer.num_updated
        pieces = [pb.UpdateGradientsRequest(ref=ref, rerouted=rerouted).SerializeToString()]
        for s, g in grads:
            pieces += codec.message_field(2, [  # UpdateGradientsRequest.slots
                pb.SlotRowGradients(slot=s).SerializeToString(),
                *codec.tensor_field(2, g, fp16=self.common.embedding_fp16,
                                    compress=self.common.lz4_compression),
            ])
        return self._call(self._update_gradients, codec.join(pieces),
                          idempotent=True).num_updated

    def _wire_dtype(self, g: np.ndarray) -> str:
        """The dtype name ``g`` travels as (float16 with ``embedding_fp16``)."""
        return "float16" if self.common.embedding_fp16 and g.dtype.kind == "f" else g.dtype.name
