"""gRPC methods whose big messages skip protobuf's copies.

A method listed here sends ``bytes`` already serialized (written by :func:`codec.join`
of :func:`codec.tensor_field` pieces, one copy of the arrays) and parses what it
receives with :func:`codec.parse` (array data stay views of the received bytes).
Protobuf would copy a 16 MB batch of embeddings about five times on the way (and
through fresh pages each time); the messages on the wire are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from persia_py.wire import codec


def _serialize(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _parser(message_class: type[Message]) -> Callable[[bytes], codec.RawMessage]:
    return lambda raw: codec.parse(message_class, raw)


def add_servicer(add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.Server,
                 *, parsed_requests: dict[str, type] | None = None,
                 bytes_answers: tuple[str, ...] = ()) -> None:
    """``add_to_server(servicer, server)`` (a generated ``add_*Servicer_to_server``),
    except that the methods in ``parsed_requests`` get their request as
    :func:`codec.parse` of the named message class, and those in ``bytes_answers``
    may answer with serialized ``bytes``."""
    captured: dict = {}

    class _Capture:
        def add_generic_rpc_handlers(self, handlers: object) -> None:
            pass

        def add_registered_method_handlers(self, name: str, handlers: dict) -> None:
            captured.update(name=name, handlers=dict(handlers))

    add_to_server(servicer, _Capture())
    name, handlers = captured["name"], captured["handlers"]
    for method, message_class in (parsed_requests or {}).items():
        handlers[method] = handlers[method]._replace(request_deserializer=_parser(message_class))
    for method in bytes_answers:
        handlers[method] = handlers[method]._replace(response_serializer=_serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def unary(channel: grpc.Channel, service: Any, method: str, *,
          response_class: type[Message], parse_response: bool = False) -> Callable:
    """A callable like a generated stub's ``method`` of ``service`` (a ServiceDescriptor)
    that takes its request as a message or as serialized ``bytes``; with
    ``parse_response`` the answer comes as :func:`codec.parse` of ``response_class``."""
    return channel.unary_unary(
        f"/{service.full_name}/{method}", request_serializer=_serialize,
        response_deserializer=_parser(response_class) if parse_response
        else response_class.FromString)
