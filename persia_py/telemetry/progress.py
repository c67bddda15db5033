"""What an NN-worker rank tells people about its training: progress, a log, metrics.

:class:`StepReporter` is told about every step by :class:`persia_py.ctx.TrainCtx`
(``forward_started``/``forward_done``/``backward_done``) and about anything else the
user wants recorded (``ctx.log(test_auc=...)``). It

* shows a progress line on rank 0 (steps, samples/s, loss, staleness): redrawn in place
  when stdout is a terminal, a plain line every ``log_every`` steps when it is not;
* writes a JSON-lines training log on rank 0, one object per step
  (``{"step", "time", "samples", "loss", "staleness", "samples_per_sec"}``) plus one per
  ``log`` call, which ``persia-launcher plot`` draws. ``step`` is 1-based (the step just
  done) and, like ``samples`` (this rank's), goes on across a resume (:meth:`resumed`,
  which logs a ``resume`` event); ``time`` is the seconds since this process started;
* feeds the rank's Prometheus metrics (:class:`persia_py.telemetry.monitoring.NNWorkerMetrics`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from typing import TextIO

from persia_py.env import PersiaEnv
from persia_py.ops.private_files import append_private
from persia_py.telemetry.events import ENV_TRAIN_LOG
from persia_py.telemetry.monitoring import (
    MetricsServer,
    NNWorkerMetrics,
    metrics_port_from_env,
    serve_metrics,
)

ENV_LOG_EVERY = "PERSIA_LOG_EVERY"
"""Steps between two progress lines when stdout is not a terminal (default 100)."""

_REDRAW_SEC = 0.2
_RATE_WINDOW_SEC = 10.0


class StepReporter:
    """Progress line, training log and metrics of one NN-worker rank."""

    def __init__(self, *, rank: int, train_log: str | None, log_every: int = 100,
                 out: TextIO | None = None, metrics: NNWorkerMetrics | None = None,
                 metrics_server: MetricsServer | None = None) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.rank = rank
        self.metrics = metrics or NNWorkerMetrics()
        self._metrics_server = metrics_server
        self._out = out or sys.stdout
        self._tty = rank == 0 and self._out.isatty()
        self._log_every = log_every
        self._file: TextIO | None = None
        if rank == 0 and train_log:
            os.makedirs(os.path.dirname(os.path.abspath(train_log)), exist_ok=True)
            self._file = append_private(train_log, buffering=1)  # closed in close()
        self._started = time.monotonic()
        self.num_steps = 0
        self.num_samples = 0
        self._window: deque[tuple[float, int]] = deque([(self._started, 0)])
        self._step_ended: float | None = None
        self._forward_started = 0.0
        self._last_draw = 0.0
        self.last_loss = math.nan
        self.last_staleness = 0

    @classmethod
    def from_environ(cls, env: PersiaEnv) -> StepReporter:
        """The reporter of this rank as the launcher configured it: training log from
        ``PERSIA_TRAIN_LOG``, metrics on ``PERSIA_METRICS_PORT`` + local rank."""
        every = os.environ.get(ENV_LOG_EVERY, "")
        metrics = NNWorkerMetrics()
        port = metrics_port_from_env(os.environ, offset=env.local_rank)
        server = (None if port is None else
                  serve_metrics(metrics.registry, port, env.bind_host, f"nn-worker rank {env.rank}"))
        return cls(rank=env.rank, train_log=os.environ.get(ENV_TRAIN_LOG) or None,
                   log_every=int(every) if every else 100, metrics=metrics,
                   metrics_server=server)

    # -- the hooks TrainCtx calls --------------------------------------------------------

    def resumed(self, *, step: int, samples: int, checkpoint: str) -> None:
        """Training goes on from ``checkpoint``: the counters go on from its ``step`` and
        ``samples`` (so the log's steps follow the first run's); a ``resume`` event in
        the training log."""
        self.num_steps, self.num_samples = step, samples
        self._window = deque([(time.monotonic(), samples)])
        self.event(event="resume", checkpoint=checkpoint, step=step, samples=samples)

    def forward_started(self) -> None:
        now = time.perf_counter()
        if self._step_ended is not None:
            self.metrics.wait_seconds.observe(now - self._step_ended)
        self._forward_started = now

    def forward_done(self) -> None:
        self.metrics.forward_seconds.observe(time.perf_counter() - self._forward_started)

    def backward_done(self, *, started: float, batch_size: int, loss: float,
                      staleness: int) -> None:
        """One step ended; ``started`` is when backward began (``time.perf_counter()``)."""
        end = time.perf_counter()
        self.metrics.backward_seconds.observe(end - started)
        self._step_ended = end
        self.num_steps += 1
        self.num_samples += batch_size
        self.last_loss, self.last_staleness = loss, staleness
        rate = self._rate()
        m = self.metrics
        m.steps.inc()
        m.samples.inc(batch_size)
        m.samples_per_second.set(rate)
        m.loss.set(loss)
        m.staleness.set(staleness)
        self._write({"step": self.num_steps, "time": round(self.elapsed, 4),
                     "samples": self.num_samples, "loss": loss, "staleness": staleness,
                     "samples_per_sec": round(rate, 2)})
        if self.rank == 0:
            self._show(rate)

    def log(self, at_step: int | None = None, /, **values: float) -> None:
        """Record values of this step (e.g. ``test_auc``; ``at_step``: of that step) in
        the training log and print them."""
        for key, value in values.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"log({key}=...) takes numbers, got {value!r}")
        step = self.num_steps if at_step is None else at_step
        self._write({"step": step, "time": round(self.elapsed, 4), **values})
        if self.rank == 0:
            self._end_line()
            shown = " ".join(f"{k} {v:.5g}" for k, v in values.items())
            self._out.write(f"step {step}: {shown}\n")
            self._out.flush()

    # -- output --------------------------------------------------------------------------

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def _rate(self) -> float:
        """Samples per second over the last ``_RATE_WINDOW_SEC`` seconds."""
        now = time.monotonic()
        self._window.append((now, self.num_samples))
        while len(self._window) > 2 and now - self._window[1][0] > _RATE_WINDOW_SEC:
            self._window.popleft()
        t0, n0 = self._window[0]
        return (self.num_samples - n0) / (now - t0) if now > t0 else 0.0

    def _line(self, rate: float) -> str:
        return (f"step {self.num_steps} | {self.num_samples} samples | {rate:,.0f} samples/s"
                f" | loss {self.last_loss:.4f} | staleness {self.last_staleness}"
                f" | {self.elapsed:,.0f}s")

    def _show(self, rate: float) -> None:
        if self._tty:
            now = time.monotonic()
            if now - self._last_draw >= _REDRAW_SEC:
                self._last_draw = now
                self._out.write("\r\x1b[2K" + self._line(rate))
                self._out.flush()
        elif self.num_steps % self._log_every == 0:
            self._out.write(self._line(rate) + "\n")
            self._out.flush()

    def _end_line(self) -> None:
        if self._tty and self._last_draw:
            self._out.write("\n")
            self._last_draw = 0.0

    def event(self, **record: object) -> None:
        """One line in the training log (rank 0), e.g. ``event="restart"``."""
        self._write({**record, "time": time.time()})

    def _write(self, record: dict) -> None:
        """One line in the training log, if this rank keeps one."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        """Print the final line, close the log and stop the metrics endpoint."""
        if self.rank == 0 and self.num_steps:
            if self._tty:
                self._last_draw = 0.0
                self._out.write("\r\x1b[2K" + self._line(self._rate()) + "\n")
            else:
                self._out.write(self._line(self._rate()) + "\n")
            self._out.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
