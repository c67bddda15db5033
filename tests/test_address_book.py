"""The job's address book (persia_py/wire/address_book.py): the supervisor writes it whole,
versioned and private; a parameter server's clients (an embedding worker's, the
checkpoint client) read it only once a call finds their server gone, and then call the
server where the book has it now. Real servers on free ports, real gRPC."""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
from grpc_calls import LogWaiter

from persia_py.checkpoint import layout as fmt
from persia_py.checkpoint.coordinator import PSCheckpointClient
from persia_py.config import CommonConfig, EmbeddingTablesConfig, GlobalConfig, SlotConfig
from persia_py.launcher.ports import free_ports
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.service import create_ps_server
from persia_py.wire.address_book import AddressBook, BookError, servers_now
from persia_py.workers.embedding_worker import EmbeddingWorker, SlotIds
from persia_py.workers.ps_client import PSClient, configure_request

GLOBAL = GlobalConfig(common_config=CommonConfig(rpc_timeout_sec=20, startup_timeout_sec=20))
EMBEDDING = EmbeddingTablesConfig(slots_config={"user": SlotConfig(dim=4)})
CONFIGURE = configure_request({"type": "sgd", "lr": 1.0}, init_lower=-0.01, init_upper=0.01,
                              weight_bound=None, seed=3)


def test_the_book_is_written_whole_private_and_versioned(tmp_path: Path) -> None:
    book = AddressBook(str(tmp_path / "addresses.json"))
    assert book.publish({"ps": ["node1:23000", "node2:23001"]}) == 1
    assert book.publish({"ps": ["node1:23000", "node3:23001"]}) == 2
    assert book.read() == (2, {"ps": ["node1:23000", "node3:23001"]})
    assert stat.S_IMODE(os.stat(book.path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["addresses.json"]  # no temporary left
    assert book.entry("ps", 1).current() == (2, "node3:23001")
    with pytest.raises(BookError, match=r"addresses.json \(version 2\): no ps replica 2"):
        book.entry("ps", 2).current()


@pytest.mark.parametrize("text", ["{not json", '{"version": "1", "roles": {}}',
                                  '{"version": 1, "roles": {"ps": [7]}}', "[1]"])
def test_a_damaged_book_is_an_error_naming_it(tmp_path: Path, text: str) -> None:
    path = tmp_path / "addresses.json"
    path.write_text(text)
    with pytest.raises(BookError, match=re.escape(str(path))):
        AddressBook(str(path)).read()
    with pytest.raises(BookError, match="missing"):
        AddressBook(str(tmp_path / "none.json")).read()


class _Server:
    """A parameter server on a free port of this machine, serving Dump and Load in ``root``."""

    def __init__(self, root: Path, port: int = 0) -> None:
        self.ps = ParameterServer(GLOBAL, EMBEDDING)
        self.server, port = create_ps_server(self.ps, f"127.0.0.1:{port}", checkpoint_root=root)
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.stop(grace=None).wait(10)
        self.ps.close()


def _train_one(worker: EmbeddingWorker, ids: list[int]) -> int:
    ref = worker.put_batch([SlotIds("user", np.array(ids, dtype=np.uint64),
                                    np.ones(len(ids), dtype=np.int32))], len(ids), True)
    worker.lookup(ref)
    return worker.update_gradients(ref, {"user": np.ones((len(set(ids)), 4), np.float32)})


def _training_in_thread(worker: EmbeddingWorker, ids: list[int]
                        ) -> tuple[threading.Thread, dict]:
    """:func:`_train_one` in a thread of its own, started: its answer (``updated``) or
    its error (``error``) lands in the dict."""
    result: dict = {}

    def train() -> None:
        try:
            result["updated"] = _train_one(worker, ids)
        except BaseException as exc:  # noqa: BLE001 - the caller checks it
            result["error"] = exc

    thread = threading.Thread(target=train)
    thread.start()
    return thread, result


@pytest.fixture
def servers(tmp_path: Path):
    made: list[_Server] = []

    def start(port: int = 0) -> _Server:
        made.append(_Server(tmp_path, port))
        return made[-1]

    yield start
    for s in made:
        s.stop()


def _counting_reads(monkeypatch) -> list[int]:
    """Reads of any address book from now on, one entry each."""
    reads: list[int] = []
    read = AddressBook.read

    def counted(book: AddressBook) -> tuple[int, dict[str, list[str]]]:
        reads.append(1)
        return read(book)

    monkeypatch.setattr(AddressBook, "read", counted)
    return reads


def test_a_client_redials_where_the_book_says_once_its_server_is_gone(
        tmp_path: Path, servers, caplog, monkeypatch) -> None:
    first = servers()
    book = AddressBook(str(tmp_path / "addresses.json"))
    book.publish({"ps": [first.address]})
    [(address, entry)] = servers_now(["unused:1"], book)  # the book's address wins
    client = PSClient(address, GLOBAL.common_config, book=entry)
    client.wait_ready()
    worker = EmbeddingWorker(GLOBAL, EMBEDDING, [client])
    try:
        worker.configure(CONFIGURE)
        # While the server stays, calls never read the book, unless an attempt failed
        # (a loaded machine can fail one: the call then looks whether it moved).
        reads = _counting_reads(monkeypatch)
        with caplog.at_level(logging.DEBUG, logger="persia_py.wire.rpc"):
            assert _train_one(worker, [1, 2]) == 2
        if "retrying in" not in caplog.text and "redialling" not in caplog.text:
            assert not reads
        monkeypatch.undo()
        caplog.clear()
        first.stop()
        waiter = LogWaiter(r"parameter server \S+ unavailable")
        [port] = free_ports(1, "127.0.0.1")
        # The server there starts only once a call was refused there: one up before the
        # client's next attempt would leave no outage there to log.
        refused = LogWaiter(rf"parameter server 127\.0\.0\.1:{port} unavailable")
        for handler in (waiter, refused):
            logging.getLogger("persia_py.wire.rpc").addHandler(handler)
        try:
            with caplog.at_level(logging.INFO):
                thread, result = _training_in_thread(worker, [1, 3])
                assert waiter.event.wait(timeout=15), "no line about the outage"
                # The book names the replica's new place before it answers there (the
                # supervisor writes it as it starts the server, which then loads its
                # checkpoint and replays its update log; empty here).
                waiter.pattern = re.compile("redialling")
                waiter.event.clear()
                assert book.publish({"ps": [f"127.0.0.1:{port}"]}) == 2  # the first removed
                assert waiter.event.wait(timeout=15), "no line about the redial"
                assert refused.event.wait(timeout=15), "no line about the new address refusing"
                second = servers(port)
                thread.join(timeout=30)
        finally:
            for handler in (waiter, refused):
                logging.getLogger("persia_py.wire.rpc").removeHandler(handler)
        assert not thread.is_alive() and result == {"updated": 2}, result
        assert client.address == second.address
        assert second.ps.configured and second.ps.num_updates == 1
        # Once, though the new address refused calls for a while: its outage goes on
        # there, under its new name, within a new deadline.
        assert caplog.text.count("redialling") == 1, caplog.text
        assert caplog.text.count(f"moved to parameter server {second.address}") == 1
        assert re.search(rf"parameter server {second.address} reachable again", caplog.text)
    finally:
        worker.close()


def test_the_checkpoint_client_follows_the_book(tmp_path: Path, servers) -> None:
    first = servers()
    book = AddressBook(str(tmp_path / "addresses.json"))
    book.publish({"ps": [first.address]})
    client = PSCheckpointClient([first.address], GLOBAL.common_config, tmp_path, book=book)
    try:
        client.wait_ready()
        first.stop()
        second = servers()
        second.ps.configure(optimizer={"type": "sgd", "lr": 1.0})
        book.publish({"ps": [second.address]})
        [answer] = client.dump(fmt.new_tmp_dir(tmp_path))
        assert answer.replica_index == 0 and client.addresses == [second.address]
    finally:
        client.close()


def test_a_client_waiting_for_its_server_to_start_finds_it_where_the_book_says(
        tmp_path: Path, servers) -> None:
    """An embedding worker started again while its server moves waits where the book says,
    not where the server was."""
    [gone, port] = free_ports(2, "127.0.0.1")
    book = AddressBook(str(tmp_path / "addresses.json"))
    book.publish({"ps": [f"127.0.0.1:{gone}"]})
    [(address, entry)] = servers_now([f"127.0.0.1:{gone}"], book)
    client = PSClient(address, GLOBAL.common_config, book=entry)
    waited: dict = {}

    def wait() -> None:
        try:
            client.wait_ready()
            waited["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - checked below
            waited["error"] = exc

    thread = threading.Thread(target=wait)
    try:
        thread.start()
        book.publish({"ps": [f"127.0.0.1:{port}"]})
        servers(port)
        thread.join(timeout=GLOBAL.common_config.startup_timeout_sec + 10)
        assert not thread.is_alive() and waited == {"ok": True}, waited
        assert client.address == f"127.0.0.1:{port}"
        client.configure(CONFIGURE)
    finally:
        thread.join(timeout=30)
        client.close()


def test_a_book_unreadable_when_a_call_fails_leaves_it_retrying_where_it_is(
        tmp_path: Path, servers, caplog) -> None:
    first = servers()
    book = AddressBook(str(tmp_path / "addresses.json"))
    book.publish({"ps": [first.address]})
    [(address, entry)] = servers_now(["unused:1"], book)
    client = PSClient(address, GLOBAL.common_config, book=entry)
    client.wait_ready()
    worker = EmbeddingWorker(GLOBAL, EMBEDDING, [client])
    try:
        worker.configure(CONFIGURE)
        port = int(first.address.rsplit(":", 1)[1])
        first.stop()
        os.unlink(book.path)  # gone while the server is away
        waiter = LogWaiter(r"addresses\.json: missing .*; retrying at this address")
        logging.getLogger("persia_py.wire.rpc").addHandler(waiter)
        try:
            with caplog.at_level(logging.INFO):
                thread, result = _training_in_thread(worker, [1, 3])
                assert waiter.event.wait(timeout=15), "no line about the book"
                second = servers(port)  # back where it was
                thread.join(timeout=30)
        finally:
            logging.getLogger("persia_py.wire.rpc").removeHandler(waiter)
        assert not thread.is_alive() and result == {"updated": 2}, result
        assert second.ps.num_updates == 1
        assert caplog.text.count("retrying at this address") == 1, caplog.text
    finally:
        worker.close()
