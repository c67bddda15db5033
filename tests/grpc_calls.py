"""Calls from the test process to the roles a test started: a channel that carries this
session's job token (:func:`token_channel`; conftest's ``job_token`` fixture sets it), a
call that must be refused (:func:`refused`), the environment without the token
(:func:`env_without_token`), and a wait for what a client in this process logs
(:class:`LogWaiter`)."""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Sequence

import grpc
import pytest

from persia_py.wire.security import ENV_AUTH_TOKEN, TokenClientInterceptor


def token_channel(address: str, options: Sequence[tuple[str, int]] = ()) -> grpc.Channel:
    """A plaintext channel with no limits of persia_py's own (for raw or malformed calls)
    that carries this session's job token, so the servers' own checks are what answer."""
    channel = grpc.insecure_channel(address, options=list(options))
    return grpc.intercept_channel(channel, TokenClientInterceptor(os.environ[ENV_AUTH_TOKEN]))


def env_without_token() -> dict[str, str]:
    """This process's environment without the session's job token."""
    return {k: v for k, v in os.environ.items() if k != ENV_AUTH_TOKEN}


def refused(call: Callable, request, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
            ) -> str:
    """``call(request)`` (a gRPC stub's method) fails with ``code``; returns the details."""
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)
    assert info.value.code() == code, info.value.details()
    return info.value.details()


class LogWaiter(logging.Handler):
    """Sets ``event`` when a record matching ``pattern`` is logged."""

    def __init__(self, pattern: str) -> None:
        super().__init__(logging.INFO)
        self.pattern, self.event = re.compile(pattern), threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.pattern.search(record.getMessage()):
            self.event.set()
