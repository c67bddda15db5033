"""The parameter server's gRPC face: decode, delegate to :class:`ParameterServer`, encode."""

from __future__ import annotations

import json
import logging
import os

import grpc
import numpy as np

from persia_py.checkpoint import rewind
from persia_py.proto import common_pb2, parameter_server_pb2_grpc
from persia_py.proto import parameter_server_pb2 as pb
from persia_py.servers import call_memory
from persia_py.servers.call_memory import LookupAnswer
from persia_py.servers.checkpoint import CheckpointRoot, add_checkpoint_service
from persia_py.servers.metrics import ParameterServerMetrics
from persia_py.servers.parameter_server import ParameterServer
from persia_py.wire import codec, shm
from persia_py.wire import raw_methods as wire_rpc
from persia_py.wire.rpc import create_server, grpc_method
from persia_py.wire.shm_calls import MappedSegments

logger = logging.getLogger(__name__)


def configure_args(request: common_pb2.ConfigureRequest) -> dict:
    """Keyword arguments of ``configure`` from a ConfigureRequest (shared with the worker)."""
    try:
        optimizer = json.loads(request.optimizer_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"optimizer_json is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError("optimizer_json is nested too deeply") from None
    if not isinstance(optimizer, dict):
        raise ValueError("optimizer_json must be a JSON object")
    return dict(
        optimizer=optimizer,
        init_lower=request.init_lower,
        init_upper=request.init_upper,
        weight_bound=request.weight_bound or None,
        seed=request.seed,
    )


_DISK_FIELDS = frozenset(pb.DiskTierStats.DESCRIPTOR.fields_by_name)


def _disk_stats(stats: dict[str, int] | None) -> pb.DiskTierStats | None:
    """A table's disk-tier counters as the Stats RPC carries them (None: no tier)."""
    if stats is None:
        return None
    return pb.DiskTierStats(**{k: v for k, v in stats.items() if k in _DISK_FIELDS})


def _answer(embeddings: list[np.ndarray], answer: list[codec.TensorFields],
            wire: LookupAnswer) -> bytes:
    """The serialized LookupResponse of ``embeddings``: the rows are in ``answer``'s
    bytes already (gathered in the wire's type), or are converted into a message built
    once (float32 rows on a float16 wire), or are compressed piece by piece (lz4).
    ``embeddings`` is emptied: a view of the message left alive would make it be copied."""
    if not answer and not wire.lz4:
        answer.append(codec.TensorFields(1, [(wire.dtype, e.shape) for e in embeddings]))
        for rows, into in zip(embeddings, answer[0].arrays):
            codec.cast_float(rows, wire.dtype, out=into)
    if answer:
        embeddings.clear()
        return answer[0].finish()
    return codec.join([piece for e in embeddings for piece in codec.tensor_field(
        1, e, fp16=wire.fp16, compress=True)])  # LookupResponse.embeddings


def _answer_in(segment: shm.Segment, embeddings: list[np.ndarray], wire: LookupAnswer,
               offsets: list[int]) -> bytes | None:
    """The serialized LookupResponse of ``embeddings`` lying in ``segment``: at ``offsets``
    where the lookup gathered them there, else converted into it now; None if they do
    not fit."""
    if not offsets:
        offsets, size = shm.layout([(wire.dtype, e.shape) for e in embeddings])
        if size > segment.size:
            return None
        for rows, offset in zip(embeddings, offsets):
            codec.cast_float(rows, wire.dtype, out=segment.array(offset, wire.dtype, rows.shape))
    return pb.LookupResponse(
        embeddings=[common_pb2.Tensor(dtype=wire.dtype, shape=e.shape) for e in embeddings],
        shm=common_pb2.ShmUse(used=True), shm_offsets=offsets).SerializeToString()


class ParameterServerServicer(parameter_server_pb2_grpc.ParameterServerServicer):
    def __init__(self, ps: ParameterServer, metrics: ParameterServerMetrics | None = None) -> None:
        self.ps = ps
        self.metrics = metrics or ParameterServerMetrics(ps)
        self.segments = MappedSegments(ps.global_config.common_config)
        """Embedding workers' shared-memory segments mapped here (persia_py/wire/shm_calls.py)."""
        self.num_shm_answers = 0
        """Lookup answers written into shared memory (for tests)."""
        self.num_shm_updates = 0
        """Updates whose gradients came through shared memory."""

    @grpc_method
    def Configure(self, request: common_pb2.ConfigureRequest, context: grpc.ServicerContext
                  ) -> common_pb2.ConfigureResponse:
        self.ps.configure(**configure_args(request))
        return common_pb2.ConfigureResponse()

    @grpc_method
    def Lookup(self, request: codec.RawMessage, context: grpc.ServicerContext) -> bytes:
        # request: a parsed pb.LookupRequest (create_ps_server)
        tables = [
            (t.table, codec.decode(t.ids, name=f"tables[{i}].ids", dtypes=("uint64",), ndim=1))
            for i, t in enumerate(request.tables)
        ]
        self.segments.forget(request.forget_segments)
        segment, refused = self.segments.offered(request.answer_segment)
        # Arrays in shared memory are never compressed.
        wire = LookupAnswer(fp16=request.fp16, lz4=request.lz4 and segment is None)
        answer: list[codec.TensorFields] = []
        placed: list[int] = []  # the offsets in the segment the rows were gathered to

        def in_answer(shapes: list[tuple[int, int]], dtypes: list[str]) -> list[np.ndarray]:
            specs: list[tuple[str, tuple[int, ...]]] = list(zip(dtypes, shapes))
            if segment is not None:
                offsets, size = shm.layout(specs)
                if size <= segment.size:
                    placed.extend(offsets)
                    return [segment.array(o, d, shape) for o, (d, shape) in zip(offsets, specs)]
            answer.append(codec.TensorFields(1, specs))
            return answer[0].arrays

        with self.metrics.lookup_seconds.time():
            embeddings = self.ps.lookup(tables, training=request.training, answer=wire,
                                        out=in_answer)
        self.metrics.lookup_ids.inc(sum(ids.size for _, ids in tables))
        if segment is None:
            if not refused:
                return _answer(embeddings, answer, wire)
            use = common_pb2.ShmUse(refused=refused)
        else:
            in_segment = None if answer else _answer_in(segment, embeddings, wire, placed)
            if in_segment is not None:
                self.num_shm_answers += 1
                if self.num_shm_answers == 1:
                    logger.info("parameter server: lookup answers go through shared memory "
                                "(an embedding worker on this host)")
                return in_segment
            needed = shm.layout([(wire.dtype, e.shape) for e in embeddings])[1]
            use = common_pb2.ShmUse(refused=f"the answer needs {needed} bytes of segment, it "
                                    f"has {segment.size}", needed_bytes=needed)
        return codec.join([_answer(embeddings, answer, wire),
                           *codec.message_field(2, [use.SerializeToString()])])

    @grpc_method
    def Prefetch(self, request: codec.RawMessage, context: grpc.ServicerContext
                 ) -> pb.PrefetchResponse:
        # request: a parsed pb.PrefetchRequest (create_ps_server); answered at once
        tables = [
            (t.table, codec.decode(t.ids, name=f"tables[{i}].ids", dtypes=("uint64",), ndim=1))
            for i, t in enumerate(request.tables)
        ]
        return pb.PrefetchResponse(queued=self.ps.prefetch(tables))

    @grpc_method
    def Update(self, request: codec.RawMessage, context: grpc.ServicerContext) -> pb.UpdateResponse:
        # request: a parsed pb.UpdateRequest (create_ps_server)
        # What the arrays claim, checked before they are decoded.
        call_memory.check_update(
            [(codec.claimed_elements(t.ids), codec.claimed_elements(t.grads), t.grads.dtype)
             for t in request.tables], self.ps.global_config.common_config.max_message_bytes)
        self.segments.forget(request.forget_segments)
        segment, refused = self.segments.offered(request.grads_segment)
        if refused:  # nothing applied: the caller sends them again
            return pb.UpdateResponse(shm=common_pb2.ShmUse(refused=refused))
        tables = [
            (
                t.table,
                codec.decode(t.ids, name=f"tables[{i}].ids", dtypes=("uint64",), ndim=1),
                # As they travelled (a view of the request, or of the segment, which the
                # embedding worker leaves alone until this call is answered): widened once,
                # by the table's check, and logged as they arrived. Finiteness is checked
                # there too.
                codec.decode(t.grads, name=f"tables[{i}].grads", dtypes=("float16", "float32"),
                             ndim=2, copy=False, data=None if segment is None
                             else segment.tensor_data(t.grads, t.grads_offset)),
            )
            for i, t in enumerate(request.tables)
        ]
        with self.metrics.update_seconds.time():
            num_updated, duplicate = self.ps.update(
                tables, worker_id=request.worker_id, sequence=request.sequence
            )
        self.metrics.update_ids.inc(num_updated)
        if segment is not None:
            self.num_shm_updates += 1
            if self.num_shm_updates == 1:
                logger.info("parameter server: gradients come through shared memory "
                            "(an embedding worker on this host)")
        return pb.UpdateResponse(num_updated=num_updated, duplicate=duplicate,
                                 shm=common_pb2.ShmUse(used=segment is not None))

    @grpc_method
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        disk = self.ps.disk_stats()
        tables = [pb.TableStats(table=name, disk=_disk_stats(disk.get(name)), **stats)
                  for name, stats in self.ps.stats().items()]
        return pb.StatsResponse(tables=tables, num_updates=self.ps.num_updates)

    @grpc_method
    def Health(self, request: common_pb2.HealthRequest, context: grpc.ServicerContext
               ) -> common_pb2.HealthResponse:
        return common_pb2.HealthResponse(role="embedding-parameter-server",
                                         configured=self.ps.configured, instance=rewind.INSTANCE)


def create_ps_server(ps: ParameterServer, address: str,
                     metrics: ParameterServerMetrics | None = None, *,
                     checkpoint_root: CheckpointRoot | str | os.PathLike | None = None,
                     ) -> tuple[grpc.Server, int]:
    """A started gRPC server for ``ps`` on ``address`` (port 0 picks one); returns (server, port).

    Training replicas also serve Dump and Load inside ``checkpoint_root`` (None: the
    current directory); serving replicas do not."""
    server, port = create_server(address, ps.global_config.common_config)
    # Lookup answers with bytes already serialized; ids and
    # gradients are read from the requests' bytes without protobuf's copies.
    wire_rpc.add_servicer(parameter_server_pb2_grpc.add_ParameterServerServicer_to_server,
                          ParameterServerServicer(ps, metrics), server,
                          parsed_requests={"Lookup": pb.LookupRequest, "Update": pb.UpdateRequest,
                                           "Prefetch": pb.PrefetchRequest},
                          bytes_answers=("Lookup",))
    add_checkpoint_service(ps, server, checkpoint_root)
    server.start()
    return server, port
