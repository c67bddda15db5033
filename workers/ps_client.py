"""Client of one parameter-server replica: numpy in, numpy out, deadlines and retries."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from persia_py.config import CommonConfig
from persia_py.proto import common_pb2, parameter_server_pb2_grpc
from persia_py.proto import parameter_server_pb2 as pb
from persia_py.wire import codec, shm
from persia_py.wire.address_book import BookEntry
from persia_py.wire.rpc import FailedPrecondition, ServiceClient
from persia_py.wire.shm_calls import SegmentLender, TensorData, segment_message


class UpdateNotApplied(FailedPrecondition):
    """A replica answered the first sending of an update ``duplicate``: it had seen the
    ``(worker id, sequence)`` pair before and did not apply the gradients.

    A retry may legitimately be answered so (its first attempt was applied, the answer
    lost); a first attempt may not: another sender used the pair (a worker id that is not
    unique, or a forged update), and counting the answer as success would lose the
    gradients silently.
    """


class PSClient(ServiceClient):
    """Talks to the parameter server at ``address``; with ``book`` (its replica's entry in
    the job's address book), at the address the book gives it once a call finds the
    server gone (a replica started on a spare node: persia_py/wire/address_book.py)."""

    service_name = "parameter server"
    stub_class = parameter_server_pb2_grpc.ParameterServerStub
    _service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    # Embeddings and gradients skip protobuf's copies.
    wire_methods = {"_lookup": (_service, "Lookup", pb.LookupResponse, True),
                    "_update": (_service, "Update", pb.UpdateResponse, False),
                    "_prefetch": (_service, "Prefetch", pb.PrefetchResponse, False)}
    # Set by ServiceClient from wire_methods; each takes a message or its bytes.
    _lookup: Callable[..., codec.RawMessage]
    _update: Callable[..., pb.UpdateResponse]
    _prefetch: Callable[..., pb.PrefetchResponse]

    def __init__(self, address: str, common: CommonConfig, *,
                 book: BookEntry | None = None) -> None:
        super().__init__(address, common, book=book)
        # Lent one call at a time: the calls in flight to this replica bound how many exist.
        self.segments = SegmentLender(common, f"parameter server {address}")

    def close(self) -> None:
        self.segments.close()
        super().close()

    def configure(self, request: common_pb2.ConfigureRequest) -> None:
        self._call("stub.Configure", request, idempotent=True)

    def _retried(self, method: Callable[..., Any], request: Any) -> Any:
        return self._call(method, request, idempotent=True)

    def lookup(self, tables: list[tuple[str, np.ndarray]], *, training: bool,
               as_float32: bool = True) -> list[np.ndarray]:
        """Embeddings ``[n, dim]`` for each ``(table, ids)``: float32, or with
        ``as_float32=False`` read-only arrays as they travelled (float16 with
        ``embedding_fp16``), for a caller that only sends them on.

        With a parameter server on this host the answer lies in a shared-memory segment
        (:mod:`persia_py.wire.shm_calls`); read-only arrays are then views of it, and it
        is lent again once they are gone."""
        ids = [piece for table, ids in tables for piece in codec.message_field(1, [
            pb.TableIds(table=table).SerializeToString(), *codec.tensor_field(2, ids)])]

        def request(segment: shm.Descriptor | None, forget: list[shm.Descriptor]) -> bytes:
            return codec.join([pb.LookupRequest(  # LookupRequest.tables follow
                training=training, fp16=self.common.embedding_fp16,
                lz4=self.common.lz4_compression,
                answer_segment=None if segment is None else segment_message(segment),
                forget_segments=[segment_message(d) for d in forget]).SerializeToString(), *ids])

        def decode(response: codec.RawMessage, in_segment: TensorData | None) -> list[np.ndarray]:
            if in_segment is not None and len(response.shm_offsets) != len(response.embeddings):
                raise codec.CodecError(f"{len(response.shm_offsets)} shared-memory offsets for "
                                       f"{len(response.embeddings)} embeddings")
            return [codec.decode(t, name=f"embeddings[{i}]", ndim=2, as_float32=as_float32,
                                 copy=as_float32,
                                 data=None if in_segment is None
                                 else in_segment(t, response.shm_offsets[i]))
                    for i, t in enumerate(response.embeddings)]

        # A training lookup may insert rows, but inserting the same ids again is a no-op
        # (initialization is a pure function of the id), so the call is safe to retry.
        # The method looked up as each attempt runs: after a redial (the address book) it
        # is the new channel's.
        return self.segments.call_for_answer(
            request, self._retried, lambda *args, **kwargs: self._lookup(*args, **kwargs),
            decode, hold=not as_float32)

    def prefetch(self, tables: list[tuple[str, np.ndarray]]) -> bool:
        """Hint that these ids will be looked up soon (a server with a disk tier brings
        their rows back into RAM in the background); whether the server queued it."""
        pieces = [piece for table, ids in tables for piece in codec.message_field(1, [
            pb.TableIds(table=table).SerializeToString(), *codec.tensor_field(2, ids)])]
        # Not retried, and within a tenth of the deadline: a late hint is worth nothing.
        return self._call(self._prefetch, codec.join(pieces), idempotent=False,
                          timeout=self.common.rpc_timeout_sec / 10).queued

    def update(
        self,
        tables: list[tuple[str, np.ndarray, np.ndarray]],
        *,
        worker_id: str,
        sequence: int,
        resend: bool = False,
    ) -> int:
        """Send gradients; ``(worker_id, sequence)`` makes a retry apply once.

        ``resend``: the caller sent this pair before. Unless it did, or this call itself
        retried, an answer ``duplicate`` raises :class:`UpdateNotApplied`.
        """
        def in_segment(segment: shm.Descriptor, forget: list[shm.Descriptor],
                       offsets: list[int]) -> bytes:
            pieces = [pb.UpdateRequest(worker_id=worker_id, sequence=sequence,
                                       grads_segment=segment_message(segment),
                                       forget_segments=[segment_message(d) for d in forget]
                                       ).SerializeToString()]
            for (table, ids, g), offset, d in zip(tables, offsets, dtypes):
                pieces += codec.message_field(1, [  # UpdateRequest.tables
                    pb.TableGradients(table=table, grads_offset=offset, grads=common_pb2.Tensor(
                        dtype=d, shape=g.shape)).SerializeToString(),
                    *codec.tensor_field(2, ids)])
            return codec.join(pieces)

        def in_message() -> bytes:
            pieces = [pb.UpdateRequest(worker_id=worker_id, sequence=sequence).SerializeToString()]
            for table, ids, g in tables:
                pieces += codec.message_field(1, [  # UpdateRequest.tables
                    pb.TableGradients(table=table).SerializeToString(),
                    *codec.tensor_field(2, ids),
                    *codec.tensor_field(3, g, fp16=self.common.embedding_fp16,
                                        compress=self.common.lz4_compression),
                ])
            return codec.join(pieces)

        dtypes = ["float16" if self.common.embedding_fp16 and g.dtype.kind == "f"
                  else g.dtype.name for _, _, g in tables]
        num_attempts = 0

        def attempt(request: bytes, **kwargs: object) -> pb.UpdateResponse:
            nonlocal num_attempts
            num_attempts += 1
            return self._update(request, **kwargs)

        # Gradients through shared memory where the replica is on this host: a refusal
        # applied nothing, and they go in the message instead.
        answer = self.segments.call_with_arrays([g for _, _, g in tables], dtypes, in_segment,
                                                self._retried, attempt)
        # A refused segment applied nothing, but an attempt before the refusal that got no
        # answer may have been applied (the server then died, and its replacement, on
        # another host, replayed it from its update log and cannot map the segment).
        sent_before = num_attempts > 1
        if answer is None:
            num_attempts = 0
            answer = self._call(attempt, in_message(), idempotent=True)
        if answer.duplicate and not resend and not sent_before and num_attempts == 1:
            raise UpdateNotApplied(
                f"parameter server {self.address} answered the first sending of update "
                f"(worker {worker_id!r}, sequence {sequence}) as a duplicate and did not apply "
                f"it: another sender used this worker id and sequence")
        return answer.num_updated

    def stats(self) -> pb.StatsResponse:
        return self._call("stub.Stats", pb.StatsRequest(), idempotent=True)


def configure_request(
    optimizer: dict, *, init_lower: float, init_upper: float, weight_bound: float | None, seed: int
) -> common_pb2.ConfigureRequest:
    """The ConfigureRequest for an optimizer dict and table settings."""
    return common_pb2.ConfigureRequest(
        optimizer_json=json.dumps(optimizer),
        init_lower=init_lower,
        init_upper=init_upper,
        weight_bound=weight_bound or 0.0,
        seed=seed,
    )
