"""An online job's roles fail alone: a failure of one role never looks, to another, like a
reason to fail.

* One ``persia-launcher local`` job following a stream loses, in turn, its data loader to
  an error of its own (exit 1), then (SIGKILL) its parameter server, its embedding worker,
  its data loader and its NN rank, while files keep arriving: each time only that role is
  restarted (the NN rank's training from the newest checkpoint, not from the start), no
  other role fails, and over the whole job every sample is trained exactly once (the
  steps a restarted rank trained again after its checkpoint aside).
* A stream file that cannot be parsed stops its loader for good (exit 65, file, row and
  column named, never restarted) after every batch made before it is trained and
  checkpointed; the job ends with that code, no NN rank failing; fixed, the same command
  goes on and trains every sample exactly once.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
from child_processes import RoleProcess, launcher_command
from online_jobs import ROWS_PER_FILE, add_file, csv_rows, run_to_its_end, start, write_config
from test_online_training import COLUMNS

from benchmarks.role_processes import role_pid
from persia_py.input.readers import CsvReaderConfig
from persia_py.input.stream_reader import CsvFormat, StreamReader
from persia_py.ops.final_errors import DATA_EXIT_CODE, DataError

BATCH = 32
"""The test loader's batch size."""


def _ids_lines(run_dir: Path) -> list[np.ndarray]:
    """Rank 0's trained sample ids, a line (step) each."""
    path = run_dir / "ids-rank0.txt"
    text = path.read_text() if path.exists() else ""
    return [np.array(line.split(), dtype=np.int64) for line in text.splitlines()]


def _wait_lines(run_dir: Path, job: RoleProcess, count: int, timeout: float = 120) -> None:
    """Until rank 0 has written ``count`` steps' ids in all (it prints a line per step)."""
    while len(_ids_lines(run_dir)) < count:
        job.wait_for_line(r"rank 0 trained \d+ samples", timeout=timeout)


def _kill(job: RoleProcess, kind: str) -> None:
    pid = role_pid(job.process.pid, kind, 0, loader_script="online_job/data_loader.py",
                   train_script="online_job/train.py")
    os.kill(pid, signal.SIGKILL)


@pytest.mark.processes
def test_each_role_failing_in_turn_is_restarted_alone(tmp_path: Path) -> None:
    stream = tmp_path / "stream"
    stream.mkdir()
    write_config(tmp_path, every_steps=4)
    files = iter(range(100))

    def add(num_files: int) -> int:
        """Files arriving; returns the steps (batches) the stream holds after them."""
        for _ in range(num_files):
            add_file(stream, next(files))
        return len(list(stream.glob("*.csv"))) * ROWS_PER_FILE // BATCH

    steps = add(3)
    run = tmp_path / "run"
    job = start(tmp_path, "run", num_ranks=1,
                loader_args=f"--crash-after-batches 6 --crash-marker {tmp_path / 'crashed'}")
    try:
        # The loader's own bug: its gRPC server goes down with the rank's long poll in it.
        job.wait_for_line(r"data-loader-0 died \(code 1\); restarting it", timeout=120)
        _wait_lines(run, job, steps)
        for kind, name in (("parameter server", "ps-0"),
                           ("embedding worker", "embedding-worker-0"),
                           ("data loader", "data-loader-0")):
            _kill(job, kind)
            job.wait_for_line(rf"{name} died \(signal SIGKILL\); restarting it", timeout=60)
            steps = add(2)
            _wait_lines(run, job, steps)
        _kill(job, "NN worker")
        restored = int(job.wait_for_line(
            r"nn-worker died .*restarting the training from checkpoint .*ckpt-(\d{12})-",
            timeout=60).group(1))
        steps = add(2)
        # The restarted rank trains again the steps after its checkpoint, then the new files.
        job.wait_for_line(rf"rank 0 trained {(steps - restored) * BATCH} samples", timeout=120)
    except BaseException:
        job.stop()
        raise
    os.kill(job.process.pid, signal.SIGTERM)
    out = job.finish(timeout=120)

    died = re.findall(r"\[launcher\] (\S+) died \(([^)]*)\)", out)
    # (The NN worker's node exits 1 when a rank dies, whatever killed the rank.)
    assert died == [("data-loader-0", "code 1"), ("ps-0", "signal SIGKILL"),
                    ("embedding-worker-0", "signal SIGKILL"), ("data-loader-0", "signal SIGKILL"),
                    ("nn-worker", "code 1")], died
    assert "batch pipeline failed" not in out and "from the start" not in out, out[-20000:]
    nn_lines = "".join(line for line in out.splitlines(keepends=True)
                       if line.startswith("[nn-worker]"))
    assert "Traceback" not in nn_lines, nn_lines[-20000:]
    # Rank 0 started twice (the NN kill alone restarted it); its first run's steps after
    # the checkpoint it went back to were trained again by its second run.
    lines = _ids_lines(run)
    first, second = (int(n) for n in (run / "starts-rank0.txt").read_text().split())
    assert first == 0 and restored <= second
    kept = lines[:restored] + lines[second:]
    every = np.sort(np.concatenate(kept))
    np.testing.assert_array_equal(every, np.arange(steps * BATCH))  # none lost, none twice


def _bad_file(folder: Path, index: int, bad_row: int) -> None:
    """Stream file ``index`` as :func:`add_file` writes it, but line ``bad_row`` (1: the
    header) has a value in column x that is not a float."""
    lines = ("sid,label,x,user,item\n"
             + csv_rows(index * ROWS_PER_FILE, ROWS_PER_FILE)).splitlines(keepends=True)
    fields = lines[bad_row - 1].split(",")
    fields[2] = "0.5abc"
    lines[bad_row - 1] = ",".join(fields)
    (folder / f"{index:03d}.csv").write_text("".join(lines))


@pytest.mark.processes
def test_a_file_that_cannot_be_parsed_ends_the_job_and_the_fixed_stream_goes_on(
        tmp_path: Path) -> None:
    stream = tmp_path / "stream"
    stream.mkdir()
    write_config(tmp_path, every_steps=4)
    for index in range(3):
        add_file(stream, index)
    _bad_file(stream, 3, bad_row=42)  # its first batch (lines 2-33) is good
    loader_args = "--idle-timeout-sec 1"
    job = start(tmp_path, "run", num_ranks=2, loader_args=loader_args)
    try:
        job.wait_for_line(r"data error: .*003\.csv: row 42: column 'x': '0\.5abc'", timeout=120)
        code = job.wait(timeout=60)
    finally:
        job.stop()
    out = "".join(job.lines)
    assert code == DATA_EXIT_CODE, out[-20000:]
    assert " died " not in out and "Traceback" not in out, out[-20000:]  # none restarted
    # Every batch made before the bad one: trained, in the final checkpoint.
    assert re.search(r"final checkpoint .*ckpt-000000000010-", out), out[-20000:]
    text = " ".join(p.read_text() for p in (tmp_path / "run").glob("ids-rank*.txt"))
    first = np.sort(np.array(text.split(), dtype=np.int64))
    np.testing.assert_array_equal(first, np.arange(3 * ROWS_PER_FILE + BATCH))
    for path in (tmp_path / "run").glob("ids-rank*.txt"):
        path.unlink()

    add_file(stream, 3)  # fixed
    add_file(stream, 4)
    out, second = run_to_its_end(tmp_path, "run2", loader_args, num_ranks=2)
    assert re.search(r"resuming from .*ckpt-000000000010-", out), out[-20000:]
    every = np.sort(np.concatenate([first, second]))
    np.testing.assert_array_equal(every, np.arange(5 * ROWS_PER_FILE))  # none lost, none twice


@pytest.mark.processes
def test_a_loader_role_told_to_hold_holds_on_a_data_error(tmp_path: Path) -> None:
    """A StatefulSet restarts a pod whatever its exit code; a data error would come back:
    the role holds, saying why, and exits 65 on SIGTERM."""
    script = tmp_path / "loader.py"
    script.write_text("from persia_py.input.readers import BadRecordError\n"
                      "raise BadRecordError('day-7.csv', 12, \"column 'x': 'a' is not a valid "
                      "float\")\n")
    job = RoleProcess(launcher_command("data-loader", "--insecure", "--hold-on-config-error",
                                       str(script)))
    try:
        job.wait_for_line(r"data error: day-7\.csv: row 12: column 'x'", timeout=60)
        job.wait_for_line(r"persia-launcher data-loader: stopped on a data error \(code 65; "
                          r"its message is above\); holding instead of exiting", timeout=60)
        assert job.process.poll() is None, job.output()
        job.process.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) == DATA_EXIT_CODE, job.output()
    finally:
        job.stop()


@pytest.mark.parametrize("text,where", [
    # a value that does not parse
    (b"sid,label,x,user,item\n0,1,0.5,3,4\n1,0,0.5abc,5,6\n", r"row 3: column 'x': '0\.5abc'"),
    # a column missing from the header, or from a row
    (b"sid,label,x,user\n0,1,0.5,3\n", r"row 1: column 'item' is missing"),
    (b"sid,label,x,user,item\n0,1,0.5,3\n", r"row 2: 4 fields, expected 5 .*no field for "
                                              r"column 'item'"),
    # an extra column
    (b"sid,label,x,user,item\n0,1,0.5,3,4,9\n", r"row 2: 6 fields, expected 5 .*1 field\(s\) "
                                                 r"after the last column 'item'"),
    # bytes that are not text where a number belongs
    (b"sid,label,x,user,item\n0,1,0.5,3,\xff\xfe\n", r"row 2: column 'item': "),
], ids=["value", "header-column", "row-column", "extra-column", "encoding"])
def test_every_kind_of_unparseable_file_is_a_data_error_naming_file_row_and_column(
        tmp_path: Path, text: bytes, where: str) -> None:
    (tmp_path / "003.csv").write_bytes(text)
    reader = StreamReader(tmp_path, CsvFormat(CsvReaderConfig(columns=COLUMNS, header=True)),
                          pattern="*.csv", idle_timeout_sec=1.0)
    with pytest.raises(DataError, match=r"003\.csv: " + where):
        list(reader.batches(10))
