"""``TrainCtx``: the context of an NN-worker rank that trains (see :mod:`persia_py.ctx`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist

from persia_py.checkpoint.coordinator import Checkpointer
from persia_py.checkpoint.dense_export import DenseExporter, dense_exporter_for
from persia_py.checkpoint.rewind import restart_count, rewind_after_restart
from persia_py.checkpoint.stateful import TrainState
from persia_py.config import GlobalConfig
from persia_py.config.checks import check_type
from persia_py.ctx.dense_step import DenseStep
from persia_py.ctx.embedding_ctx import check_looked_up
from persia_py.ctx.train_checkpoints import CheckpointedCtx, entered
from persia_py.ctx.train_checks import (
    check_arguments,
    check_checkpoint_config,
    check_sharded_options,
)
from persia_py.dense.graceful_stop import StopOnSignal
from persia_py.dense.grad_control import GradControl
from persia_py.dense.process_group import (
    PeerFailure,
    init_process_group,
    naming_peers,
    settle_finished_collectives,
)
from persia_py.distributed import (
    DDPOption,
    DenseParallel,
    FSDPOption,
    is_deferred,
    materialize,
)
from persia_py.embedding import EmbeddingConfig
from persia_py.embedding.data import PersiaBatch
from persia_py.embedding.optim import Optimizer
from persia_py.env import PersiaEnv
from persia_py.ops.final_errors import (
    config_errors_are_final,
    made_progress,
    refusals_are_config_errors,
    report_failure,
)
from persia_py.progressive import ProgressiveValidation
from persia_py.telemetry.progress import StepReporter
from persia_py.wire.address_book import book_at
from persia_py.workers.batches import TrainingBatch
from persia_py.workers.gradient_sender import GradientSender
from persia_py.workers.nn_worker import BatchStream, DataLoaderSource
from persia_py.workers.ps_client import configure_request

logger = logging.getLogger(__name__)


class TrainCtx(CheckpointedCtx):
    """Context of a training NN worker (as PERSIA's ``TrainCtx``).

    Args:
        model: the dense tower; called as ``model(non_id_tensors, embedding_tensors)``.
            One from :func:`persia_py.distributed.build_on_meta` (parameters on the meta
            device) is materialized on entry, unit by unit under ``FSDPOption``.
        embedding_optimizer: :mod:`persia_py.embedding.optim` optimizer, run on the servers.
        dense_optimizer: a ``torch.optim`` optimizer over ``model``'s parameters.
        embedding_config: initialization bounds, weight bound and seed of new rows.
        device_id: CUDA device; None: ``cuda:LOCAL_RANK`` where CUDA is available, else
            the CPU (see :func:`persia_py.dense.device.pick_device`).
        mixed_precision: run the model under autocast: float16 with a gradient scaler on
            CUDA, bfloat16 on CPU. Embedding rows keep their ``row_dtype`` on the servers.
        distributed_option: how the ranks share the dense tower:
            :class:`~persia_py.distributed.DDPOption` (default; a replica per rank) or
            :class:`~persia_py.distributed.FSDPOption` (sharded, with a bound on the
            unsharded bytes alive at once: its own, else the config's
            ``nn_worker_config.fsdp_max_unsharded_bytes``).
        stop_on_signal: online training: SIGTERM ends the data loaders' endless stream
            after a step every rank agrees on; the embedding updates are flushed and a
            final checkpoint is written to ``checkpoint_config.dir`` (required) before the
            loop ends (see :mod:`persia_py.dense.graceful_stop`). With that folder set, a
            stream that ends by itself (the loaders' scripts end, ``idle_timeout_sec``)
            ends with a final checkpoint there too.
        progressive_validation: a :class:`~persia_py.progressive.ProgressiveValidation`:
            each training batch's outputs (scored before its update) give a running AUC,
            log loss and NE (and GAUC) in the training log.
        grad_clip_norm: clip the dense gradients to this total L2 norm before each dense
            step (None: no clipping); embedding gradients are not clipped.
        grad_accumulation_steps: batches per dense optimizer step, on the mean of their
            dense gradients (1: every batch, as PERSIA); DDP allreduces once per step.
            Embedding gradients still go to the servers with every batch. Not with
            ``FSDPOption`` on several ranks. See :mod:`persia_py.dense.grad_control`.
    """

    _training = True
    _usage = "TrainCtx(...)"

    @config_errors_are_final
    def __init__(self, *, model: torch.nn.Module, embedding_optimizer: Optimizer,
                 dense_optimizer: torch.optim.Optimizer,
                 embedding_config: EmbeddingConfig | None = None,
                 device_id: int | None = None, mixed_precision: bool = False,
                 global_config: GlobalConfig | None = None, env: PersiaEnv | None = None,
                 distributed_option: DDPOption | FSDPOption | None = None,
                 stop_on_signal: bool = False, grad_clip_norm: float | None = None,
                 grad_accumulation_steps: int = 1,
                 progressive_validation: ProgressiveValidation | None = None) -> None:
        # Every argument's type first, before any file or environment is read.
        check_arguments(model, embedding_optimizer, dense_optimizer, embedding_config,
                        mixed_precision, stop_on_signal, progressive_validation,
                        distributed_option)
        self.grad_control = GradControl(grad_clip_norm=grad_clip_norm,
                                        grad_accumulation_steps=grad_accumulation_steps)
        """Clipping and accumulation of the dense gradients (see persia_py.dense.grad_control)."""
        super().__init__(model=model, global_config=global_config, device_id=device_id, env=env)
        check_checkpoint_config(self.global_config.checkpoint_config, self.grad_control,
                                stop_on_signal)
        self.distributed_option = distributed_option or DDPOption()
        if isinstance(self.distributed_option, FSDPOption):
            self.distributed_option = self.distributed_option.with_config_bound(
                self.global_config.nn_worker_config.fsdp_max_unsharded_bytes)
        # A bound below one unit's need is refused here, before any process starts.
        self.distributed_option.check(model, self.env.world_size)
        check_sharded_options(self.distributed_option, self.env.world_size, self.grad_control,
                              self.global_config.checkpoint_config)
        self.dense: DenseParallel = DenseParallel(model, model)
        """The dense tower as the ranks share it (DDP, FSDP, or whole with one rank)."""
        self.mixed_precision = mixed_precision
        self.dense_step = DenseStep(
            dense_optimizer, self.grad_control, self.dense, rank=self.env.rank,
            scaler=(torch.amp.GradScaler("cuda")
                    if mixed_precision and self.device.type == "cuda" else None))
        """Backward and the dense optimizer step (see persia_py.ctx.dense_step)."""
        self.embedding_optimizer = embedding_optimizer
        self.dense_optimizer = dense_optimizer
        self.embedding_config = embedding_config or EmbeddingConfig()
        self.ddp_model: torch.nn.Module = model
        self._sender: GradientSender | None = None
        self._pending: tuple[TrainingBatch, list[torch.Tensor]] | None = None
        self._owns_process_group = False
        self._rank_addresses: list[str] = []
        self._peer_failed = False
        self.staleness: int = 0
        """Staleness of the batch of the current step (see ``TrainingBatch.staleness``)."""
        self._staleness_sum = 0
        self._staleness_max = 0
        self._num_steps = 0  # in this context, for the staleness figures
        self.train_state = TrainState()
        """Batches this rank has trained, counting those before a resumed checkpoint."""
        self._checkpointer: Checkpointer | None = None
        self.dense_exporter: DenseExporter | None = None
        """Rank 0's writer of dense versions for serving (``checkpoint_config.dense_export_*``)."""
        self._reporter: StepReporter | None = None
        self.stop: StopOnSignal | None = StopOnSignal(self.device) if stop_on_signal else None
        """With ``stop_on_signal``: the stop request and the ranks' agreement on it."""
        self._steps_checked = 0
        self.progressive = progressive_validation
        if self.progressive is not None:  # its reports go to the log at the job's step
            self.progressive.bind(self.device, lambda report: self.reporter.log(
                self.train_state.job_step, **report))

    def __enter__(self) -> TrainCtx:
        super().__enter__()
        if self.stop is not None:
            self.stop.install()
        self._reporter = reporter = StepReporter.from_environ(self.env)
        if not is_deferred(self.model):  # a build_on_meta model is materialized by wrap
            self.model.to(self.device)
        elif self.env.world_size == 1:
            materialize(self.model, self.dense_optimizer, self.device)
        if self.env.world_size > 1:
            if not dist.is_initialized():
                backend = self.distributed_option.backend or (
                    "nccl" if self.device.type == "cuda" else "gloo")
                self._rank_addresses = init_process_group(backend, self.common)
                self._owns_process_group = True
            with refusals_are_config_errors():  # the model or optimizer refused as given
                self.dense = self.distributed_option.wrap(
                    self.model, self.dense_optimizer, self.device,
                    shadow_step=self._shadow_step, registry=reporter.metrics.registry)
            self.ddp_model = self.dense.module
            self.dense_step.dense = self.dense
            if self.dense_step.scaler is not None and self.dense.sharded:
                # Each rank holds other gradient shards: the ranks must agree on skipping.
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.dense_step.scaler = ShardedGradScaler("cuda")
        # Before the embedding workers are configured: a rewind restarts them.
        back_to = rewind_after_restart(
            periodic_dir=self.global_config.checkpoint_config.dir,
            loaders=list(self.env.data_loader_addrs),
            embedding_workers=list(self.env.embedding_worker_addrs), common=self.common,
            rank=self.env.rank)
        if back_to is not None:
            count = restart_count()
            reporter.metrics.restarts.labels(role="nn-worker").inc(count)
            reporter.event(event="restart", role="nn-worker", reason="torchrun restart "
                                f"{count}", checkpoint=back_to)
            if dist.is_initialized():
                dist.barrier()  # no rank pulls a batch before every loader is rewound
        cfg = self.embedding_config
        request = configure_request(
            self.embedding_optimizer.to_dict(), init_lower=cfg.emb_initialization[0],
            init_upper=cfg.emb_initialization[1], weight_bound=cfg.weight_bound, seed=cfg.seed,
        )
        for w in self.workers:
            w.configure(request)
        self._sender = GradientSender(self.workers, max_in_flight=8)
        self._checkpointer = checkpointer = Checkpointer(
            self.state_dict(), flush=self.flush, ps_addrs=self.env.ps_addrs, common=self.common,
            config=self.global_config.checkpoint_config, device=self.device,
            sharded_dense=self.dense.sharded, book=book_at(self.env.address_book))
        if (resumed := checkpointer.resume_if_asked(back_to)) is not None:
            self._resumed(resumed)
        self.dense_exporter = dense_exporter_for(self.global_config.checkpoint_config,
                                                 rank=self.env.rank,
                                                 sharded=self.dense.sharded)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            report_failure(self.env.rank, exc)
        if self._num_steps:
            logger.info("rank %d: %d steps, embedding staleness mean %.2f max %d, peak buffer "
                        "%d bytes", self.env.rank, self._num_steps,
                        self.mean_staleness, self._staleness_max,
                        self.budget.peak)
        if self.dense.summary():
            logger.info("rank %d: %s", self.env.rank, self.dense.summary())
        try:
            if self._sender is not None:
                if exc_type is None:
                    self._sender.flush(self.common.rpc_timeout_sec)
                self._sender.close()
            if self._checkpointer is not None:
                self._checkpointer.close()
            if self.dense_exporter is not None:
                if exc_type is None:  # serving gets the final model too
                    self.dense_exporter.export(self.model)
                self.dense_exporter.close()
        finally:
            if self.stop is not None:
                self.stop.restore()
            if self._reporter is not None:
                self._reporter.close()
            if exc_type is None and not self._peer_failed:
                # gloo's worker threads must free the collectives they finished while the
                # interpreter runs, or the rank may abort at its exit (see there). FSDP's
                # ranks leave together (every forward is collective); DDP's may not (rank
                # 0 evaluating alone), so they only pause.
                settle_finished_collectives(barrier=self.dense.sharded)
            if self._owns_process_group and dist.is_initialized() and not self._peer_failed:
                # After a peer failed, tearing the group down would wait on the store
                # behind the same dead link; exiting releases it anyway.
                dist.destroy_process_group()
            super().__exit__(exc_type, exc, tb)

    @property
    def num_dense_steps_skipped(self) -> int:
        """Dense optimizer steps skipped for non-finite gradients (without a gradient
        scaler; with one, the scaler skips and lowers its scale)."""
        return self.dense_step.num_skipped

    @property
    def mean_staleness(self) -> float:
        """Mean staleness of the batches trained so far in this context."""
        return self._staleness_sum / self._num_steps if self._num_steps else 0.0

    def flush(self) -> None:
        """Wait until the servers have acknowledged every embedding update sent so far."""
        self._require_active("ctx.flush")
        entered(self._sender, "TrainCtx's gradient sender").flush(self.common.rpc_timeout_sec)

    def log(self, **values: float) -> None:
        """Record numbers of this step (e.g. ``ctx.log(test_auc=auc)``) in the training log."""
        self._require_active("ctx.log")
        self.reporter.log(**values)

    def prepare(self, batch: PersiaBatch) -> TrainingBatch:
        """Look up one evaluation batch (see :meth:`EmbeddingCtx.prepare`)."""
        check_type("ctx.prepare(batch)", batch, PersiaBatch,
                   "a persia_py.embedding.data.PersiaBatch")
        if batch.requires_grad:
            raise ValueError(
                "ctx.prepare looks up one evaluation batch (requires_grad=False); a training "
                "batch made in this process goes through "
                "persia_py.data.DataLoader(IterableDataset), which bounds its embedding "
                "staleness and bytes as for the data loaders' batches")
        return super().prepare(batch)

    def stream_local(self, batches: Iterable[PersiaBatch], *, buffer_size: int,
                     reproducible: bool, embedding_staleness: int) -> Iterator[TrainingBatch]:
        """Batches made in this process (see :meth:`EmbeddingCtx.stream_local`). Each rank
        reads its own dataset, and their lengths may differ: as with the data loaders'
        stream, a rank out of batches joins the others' steps until all are done."""
        with self._joined():
            yield from super().stream_local(batches, buffer_size=buffer_size,
                                            reproducible=reproducible,
                                            embedding_staleness=embedding_staleness)
        self.dense_step.finish(self.train_state.steps, self.device, self._naming_peers)
        self._report_last_window()

    def _joined(self):
        """``torch.distributed.algorithms.Join`` over the dense tower (a rank out of
        batches shadows the others' collectives: DDP's allreduce, FSDP's gathers) and
        the checkpointer (its hook keeps periodic checkpoints from waiting for that
        rank); nothing with one rank."""
        if self.dense.joinable is None:
            return nullcontext()
        joinables = [self.dense.joinable, self.checkpointer]  # in the order of their collectives
        if self.progressive is not None:
            joinables.append(self.progressive)
        if self.stop is not None:
            joinables.append(self.stop)
        return torch.distributed.algorithms.Join(joinables)

    def stream_from_loaders(self, *, buffer_size: int, reproducible: bool,
                            embedding_staleness: int) -> Iterator[TrainingBatch]:
        if reproducible and (embedding_staleness != 1 or self.env.world_size != 1):
            raise ValueError(
                "reproducible=True needs embedding_staleness=1 and one NN-worker rank "
                f"(got staleness {embedding_staleness}, {self.env.world_size} ranks): with more, "
                "the order in which updates reach the servers depends on timing")
        source = DataLoaderSource(rank=self.env.rank,
                                  data_loader_addrs=self.env.data_loader_addrs,
                                  common=self.common, reproducible=reproducible)
        stream = BatchStream(source=source, workers=self.workers, staleness=embedding_staleness,
                             buffer_size=buffer_size, reproducible=reproducible,
                             budget=self.budget)
        try:
            # Ranks may receive different numbers of batches: Join lets the ranks that run
            # out shadow the others' collectives, so every batch is trained.
            # Asked to stop while no batch comes (an idle stream), a rank leaves the loop
            # as at the stream's end: Join then completes the others' step in progress.
            stop = self.stop
            interrupted = None if stop is None else (lambda: stop.requested)
            with self._joined():
                for batch in stream.batches(interrupted):
                    yield batch
                    if self._stop_agreed():
                        break
            self.dense_step.finish(self.train_state.steps, self.device, self._naming_peers)
            self.flush()
            if dist.is_initialized():
                # After this, every rank's embedding updates are on the servers.
                with self._naming_peers("the end-of-stream barrier"):
                    dist.barrier()
            # Every rank is here: one more agreement covers ranks that left the loop on
            # their own request without one (every rank idle, say).
            signalled = self.stop is not None and self._agree_to_stop(self.stop)
            self._report_last_window()
            if self.checkpointer.periodic_dir:  # however it ends: the restart goes on there
                self.checkpointer.final("a signal" if signalled else "the end of the stream")
        finally:
            stream.close()

    def _stop_agreed(self) -> bool:
        """After a training step, with ``stop_on_signal``: whether every rank stops now."""
        if self.stop is None or self._num_steps == self._steps_checked:
            return False  # no training step since the last check: nothing to agree after
        self._steps_checked = self._num_steps
        return self._agree_to_stop(self.stop)

    def _agree_to_stop(self, stop: StopOnSignal) -> bool:
        with self._naming_peers("the agreement to stop"):
            return stop.agreed()

    def _report_last_window(self) -> None:
        """Every rank, when training ends: progressive validation's last, shorter window."""
        if self.progressive is not None:
            self.progressive.report_partial()

    def forward(self, batch: TrainingBatch, *, model: torch.nn.Module | None = None):
        """Forward ``batch``; training batches keep what ``backward`` needs. No ``model``:
        the tower trained is the context's own."""
        if model is not None:
            raise TypeError("TrainCtx.forward takes no model=: the tower it trains is the "
                            "context's own (TrainCtx(model=...))")
        check_looked_up(batch)
        self._require_active("ctx.forward")
        if not batch.requires_grad:
            if batch.batch_id is not None:  # a loader's evaluation batch is done once seen
                self.train_state.new_batch_ids.append(batch.batch_id)
            return super().forward(batch)
        entered(self._sender, "TrainCtx's gradient sender").raise_if_failed()
        if self._pending is not None:
            raise RuntimeError("ctx.forward called twice without ctx.backward in between; "
                               "call ctx.backward(loss) after each training forward")
        self.reporter.forward_started()
        rows, embeddings = self._embedding_tensors(batch, requires_grad=True)
        dense = [t.to(self.device) for t in batch.non_id_type_features]
        # DDP's forward may sync buffers with the other ranks: a collective too.
        # Inside an accumulation window, DDP must know at forward that this backward
        # does not allreduce (no_sync).
        self.dense.set_gradient_sync(self.grad_control.steps_at(self.train_state.steps + 1))
        with self._autocast(), self._naming_peers("the dense model's forward"):
            self.dense.before_forward(dense, embeddings)
            output = self.ddp_model(dense, embeddings)
        self._pending = (batch, rows)
        self.staleness = batch.staleness
        self._staleness_sum += batch.staleness
        self._staleness_max = max(self._staleness_max, batch.staleness)
        self._num_steps += 1
        self.train_state.trained(batch.batch_id, batch.batch_size)
        self.reporter.forward_done()
        labels = [t.to(self.device) for t in batch.labels]
        if self.progressive is not None:  # scored before this batch's update: unseen data
            self.progressive.observe(batch, output, labels)
        return output, labels

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward, dense optimizer step, and embedding gradients sent to the servers.
        With ``grad_accumulation_steps=k`` the dense step is taken after every k-th
        batch; with ``grad_clip_norm`` the dense gradients are clipped first. A dense step
        whose gradients are not all finite is skipped on every rank (counted in
        ``num_dense_steps_skipped``); the embedding worker skips non-finite embedding
        gradients per slot."""
        check_type("ctx.backward(loss)", loss, torch.Tensor, "the loss, a torch.Tensor")
        self._require_active("ctx.backward")
        if self._pending is None:
            raise RuntimeError("ctx.backward called without a training ctx.forward before it; "
                               "call output, labels = ctx.forward(batch) first, once per "
                               "backward")
        batch, rows = self._pending
        self._pending = None
        started = time.perf_counter()
        try:
            with self._naming_peers("the dense gradients' allreduce"):
                unscale = self.dense_step.backward(loss, self.train_state.steps)
        except BaseException:
            batch.release()
            raise
        # An overflowed scaled gradient stays non-finite after unscaling; the embedding
        # worker skips (and counts) it per slot, as the scaler skips the dense step.
        grads: list[tuple[str, np.ndarray]] = []
        for s, r in zip(batch.slots, rows):
            if r.grad is None:  # the model did not use this slot
                grads.append((s.slot, np.zeros(tuple(r.shape), np.float32)))
                continue
            g = r.grad.detach().cpu()  # float16 where pooled as it arrived: sent as it is
            grads.append((s.slot, g.numpy() if unscale is None else g.float().numpy() * unscale))
        entered(self._sender, "TrainCtx's gradient sender").submit(batch, grads)
        if self._num_steps == 1:  # a config error from now on is no longer one at start
            made_progress()
        self.checkpointer.after_step()
        self.reporter.backward_done(started=started, batch_size=batch.batch_size,
                                    loss=float(loss.detach()), staleness=batch.staleness)
        if self.progressive is not None:
            self.progressive.after_step()  # a report is due: into the log (bind)
        if self.dense_exporter is not None:  # rank 0 pushes the dense model to serving
            self.dense_exporter.after_step(self.model)
        return loss

    @contextmanager
    def _naming_peers(self, what: str) -> Iterator[None]:
        try:
            with naming_peers(what, self._rank_addresses, self.env.rank, self.common):
                yield
        except PeerFailure:
            self._peer_failed = True
            raise

    def _shadow_step(self, dense: list[torch.Tensor], embeddings: list[torch.Tensor]) -> None:
        """A step of a rank out of batches while the others train on (FSDP): a batch's
        inputs again (its last, or another rank's if it had none), with a zero loss, so
        that it takes part in every all-gather and reduce-scatter (contributing zero
        gradients) and steps its optimizer shard."""
        with self._autocast(), self._naming_peers("the dense model's shadow step"):
            output = self.ddp_model(dense, embeddings)
            outputs = output if isinstance(output, (list, tuple)) else [output]
            self.dense_step.backward(sum(o.float().sum() for o in outputs) * 0.0,
                                     self.train_state.steps)
