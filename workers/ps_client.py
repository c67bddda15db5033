"""Client of one parameter-server replica: numpy in, numpy out, deadlines and retries."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from persia_py.proto import common_pb2, parameter_server_pb2_grpc
from persia_py.proto import parameter_server_pb2 as pb
from persia_py.wire import codec
from persia_py.wire.rpc import FailedPrecondition, ServiceClient


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

    def configure(self, request: common_pb2.ConfigureRequest) -> None:
        self._call("stub.Configure", request, idempotent=True)

    def lookup(self, tables: list[tuple[str, np.ndarray]], *, training: bool,
               as_float32: bool = True) -> list[np.ndarray]:
        """Embeddings ``[n, dim]`` for each ``(table, ids)``: float32, or with
        ``as_float32=False`` read-only arrays as they travelled (float16 with
        ``embedding_fp16``), for a caller that only sends them on."""
        pieces = [pb.LookupRequest(training=training, fp16=self.common.embedding_fp16,
                                   lz4=self.common.lz4_compression).SerializeToString()]
        for table, ids in tables:
            pieces += codec.message_field(1, [  # LookupRequest.tables
                pb.TableIds(table=table).SerializeToString(), *codec.tensor_field(2, ids)])
        request = codec.join(pieces)
        # A training lookup may insert rows, but inserting the same ids again is a no-op
        # (initialization is a pure function of the id), so the call is safe to retry.
        response = self._call("_lookup", request, idempotent=True)
        return [
            codec.decode(t, name="embeddings", ndim=2, as_float32=as_float32, copy=as_float32)
            for t in response.embeddings
        ]

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
        pieces = [pb.UpdateRequest(worker_id=worker_id, sequence=sequence).SerializeToString()]
        for table, ids, g in tables:
            pieces += codec.message_field(1, [  # UpdateRequest.tables
                pb.TableGradients(table=table).SerializeToString(),
                *codec.tensor_field(2, ids),
                *codec.tensor_field(3, g, fp16=self.common.embedding_fp16,
                                    compress=self.common.lz4_compression),
            ])
        num_attempts = 0

        def attempt(request: bytes, **kwargs: object) -> pb.UpdateResponse:
            nonlocal num_attempts
            num_attempts += 1
            return self._update(request, **kwargs)

        answer = self._call(attempt, codec.join(pieces), idempotent=True)
        if answer.duplicate and not resend and num_attempts == 1:
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
