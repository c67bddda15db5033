"""Client of one parameter-server replica: numpy in, numpy out, deadlines and retries."""

from __future__ import annotations

import json

import numpy as np

from persia_py import codec, wire_rpc
from persia_py.config import CommonConfig
from persia_py.proto import common_pb2, parameter_server_pb2_grpc
from persia_py.proto import parameter_server_pb2 as pb
from persia_py.rpc import OutageLog, call, create_channel, wait_for_ready


class PSClient:
    """Talks to the parameter server at ``address``."""

    def __init__(self, address: str, common: CommonConfig) -> None:
        self.address = address
        self.common = common
        self.channel = create_channel(address, common)
        self.stub = parameter_server_pb2_grpc.ParameterServerStub(self.channel)
        service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
        # Embeddings and gradients skip protobuf's copies (persia_py.wire_rpc).
        self._lookup = wire_rpc.unary(self.channel, service, "Lookup",
                                      response_class=pb.LookupResponse, parse_response=True)
        self._update = wire_rpc.unary(self.channel, service, "Update",
                                      response_class=pb.UpdateResponse)
        self._outages = OutageLog()

    def wait_ready(self) -> None:
        wait_for_ready(self.channel, self.address, self.common.startup_timeout_sec)

    def _call(self, method, request, *, idempotent: bool):
        return call(method, request, timeout=self.common.rpc_timeout_sec, idempotent=idempotent,
                    what=f"parameter server {self.address}", outages=self._outages)

    def configure(self, request: common_pb2.ConfigureRequest) -> None:
        self._call(self.stub.Configure, request, idempotent=True)

    def lookup(self, slots: list[tuple[str, np.ndarray]], *, training: bool,
               as_float32: bool = True) -> list[np.ndarray]:
        """Embeddings ``[n, dim]`` for each ``(slot, ids)``: float32, or with
        ``as_float32=False`` read-only arrays as they travelled (float16 with
        ``embedding_fp16``), for a caller that only sends them on."""
        pieces = [pb.LookupRequest(training=training, fp16=self.common.embedding_fp16,
                                   lz4=self.common.lz4_compression).SerializeToString()]
        for s, ids in slots:
            pieces += codec.message_field(1, [  # LookupRequest.slots
                pb.SlotIds(slot=s).SerializeToString(), *codec.tensor_field(2, ids)])
        request = codec.join(pieces)
        # A training lookup may insert rows, but inserting the same ids again is a no-op
        # (initialization is a pure function of the id), so the call is safe to retry.
        response = self._call(self._lookup, request, idempotent=True)
        return [
            codec.decode(t, name="embeddings", ndim=2, as_float32=as_float32, copy=as_float32)
            for t in response.embeddings
        ]

    def update(
        self,
        slots: list[tuple[str, np.ndarray, np.ndarray]],
        *,
        worker_id: str,
        sequence: int,
    ) -> int:
        """Send gradients; ``(worker_id, sequence)`` makes a retry apply once."""
        pieces = [pb.UpdateRequest(worker_id=worker_id, sequence=sequence).SerializeToString()]
        for s, ids, g in slots:
            pieces += codec.message_field(1, [  # UpdateRequest.slots
                pb.SlotGradients(slot=s).SerializeToString(),
                *codec.tensor_field(2, ids),
                *codec.tensor_field(3, g, fp16=self.common.embedding_fp16,
                                    compress=self.common.lz4_compression),
            ])
        return self._call(self._update, codec.join(pieces), idempotent=True).num_updated

    def stats(self) -> pb.StatsResponse:
        return self._call(self.stub.Stats, pb.StatsRequest(), idempotent=True)

    def close(self) -> None:
        self.channel.close()


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
