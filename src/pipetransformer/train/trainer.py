"""The training loop: it wires this package's components together and reads top to bottom.

A step: sampler -> replica's share -> frozen prefix (cache or no-grad forward) -> stages -> gradient sync ->
control vector (one world all-reduce, on the device) -> clip -> optimizer -> control ledger. At a step whose
decisions need them (a logged step, a freeze window's end, an evaluation, a checkpoint, an epoch's or the run's end,
and at least every ``STOP_READ_STEPS``-th) the host reads the ledger: every pending step's numbers are checked and
observed in order, and a stop request is acted on. Then AutoFreeze decides; a new frozen set is applied, re-planned
and handed over to the new layout.
``docs/architecture.md`` names each arrow's module.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from typing import Any

import torch

from pipetransformer.config import Config
from pipetransformer.data.sampler import ElasticSampler
from pipetransformer.distributed import gather_floats, init_distributed, shutdown_distributed
from pipetransformer.metrics import StepTimer, peak_rss_bytes
from pipetransformer.optim import lr_at
from pipetransformer.pipe.cost import Precision
from pipetransformer.train.autocache import AutoCache
from pipetransformer.train.autofreeze import AutoFreeze
from pipetransformer.train.build import (build_blocks, check_data_fits_model, describe_model, load_splits,
                                         resolve_run_dir, seed_everything)
from pipetransformer.train.checkpointer import Checkpointer
from pipetransformer.train.control import ControlLedger, StopSignals, gather_control
from pipetransformer.train.elastic import ElasticLayout
from pipetransformer.train.evaluator import Evaluator
from pipetransformer.train.optimizer import HeldOptimizer
from pipetransformer.train.profiling import StepProfiler
from pipetransformer.train.recorder import (RunRecorder, bar_samples, data_record, stop_record,
                                            warn_if_max_steps_out_of_reach)
from pipetransformer.train.state import Progress, TrainState
from pipetransformer.train.step import StepContext, StepResult
from pipetransformer.train.task import Task, task_for

__all__ = ["Trainer", "train"]

logger = logging.getLogger(__name__)

RNG_MODULUS = 2**63  # torch.manual_seed takes a 64-bit seed
STOP_READ_STEPS = 10
"""The device is read at least every this many steps, whatever ``run.log_every``: a stop request (SIGTERM, Ctrl-C) is
acted on within them. On a GPU a read is one wait for the queued work, so this costs at most one step's overlap in
ten."""


class Trainer:
    """Runs one training job on this process (one of the torchrun workers, or alone)."""

    def __init__(self, config: Config, task: Task | None = None) -> None:
        self.config, self.task = config, task or task_for(config.model.kind)
        self.env = env = init_distributed(config.dist)
        seed_everything(config)
        self.run_dir = resolve_run_dir(config.run)
        self.train_set, self.eval_set, self.test_set = load_splits(config, env)
        self.rss_before_model = peak_rss_bytes()  # the runtime and the data: what the memory plan does not count
        self.model = build_blocks(config, self.task.outputs(self.train_set), env.device)
        check_data_fits_model(config, self.model, self.train_set)
        if env.is_main:  # the one line of a launch about the model (every process loads it, quietly)
            logger.info("model: %s", describe_model(config, self.model))
        self.sampler = ElasticSampler(len(self.train_set), seed=config.seed, drop_last=config.train.drop_last)
        batch = config.train.batch_size  # planned steps at the starting batch: what a fraction window is a share of
        self.freezer = AutoFreeze.from_config(config, self.model, warn=env.is_main,
                                              planned_steps=math.ceil(self._total_samples() / batch),
                                              steps_per_epoch=math.ceil(len(self.train_set) / batch))
        self.progress = Progress()
        self.optimizer = HeldOptimizer(self.model, config.train)
        max_length = config.data.max_length
        self.cache = AutoCache(self.model, env, config.cache, train_set=self.train_set, eval_samples=len(self.eval_set),
                               max_length=max_length)
        context = StepContext(self.model, self.task, self.train_set, max_length, env.device, self.cache)
        self.layout = ElasticLayout(context, env, pipe=config.pipe, dp=config.dp, batch_size=batch,
                                    precision=Precision(config.train.precision))
        self.evaluator = Evaluator(self.model, self.task, env, batch_size=config.train.eval_batch_size,
                                   layout=self.layout, cache=self.cache)
        self.state = TrainState(model=self.model, optimizer=self.optimizer, sampler=self.sampler,
                                freezer=self.freezer, layout=self.layout, progress=self.progress, config=config)
        self.checkpointer = Checkpointer(config.checkpoint, self.run_dir, env)
        resumed = self.checkpointer.resume(self.state)
        start_freeze = None if resumed else self.freezer.start_record()
        if start_freeze is not None:
            self.progress.freeze_decisions.append(start_freeze)
        self.layout.follow(self.freezer, self.optimizer, self.progress)
        self.recorder = RunRecorder(self.run_dir, config, env, resumed_at=self.progress.step if resumed else None,
                                    cache_metrics=self.cache.metrics)
        if start_freeze is not None:
            self.recorder.event("freeze", start_freeze)
        self.stop_signals = StopSignals(lone_process=env.world_size == 1)
        self.ledger = ControlLedger()
        self.profiler = StepProfiler(config.run.profile_steps, self.run_dir, env.rank, env.device)
        self.recorder.write_config(config)

    def fit(self) -> dict[str, Any]:
        cfg, progress = self.config.train, self.progress
        started = time.perf_counter() - progress.elapsed_before_s
        timer = StepTimer(self.env.device)
        batch = self.layout.global_batch()
        if self.env.is_main:
            warn_if_max_steps_out_of_reach(cfg, len(self.train_set), batch, self.sampler.drop_last)
        self.recorder.start(started, bar_samples(self._total_samples(), cfg.max_steps, batch),
                            self.state.samples_done())
        resumed_mid_epoch = progress.step > 0 and not progress.epoch_done
        first_epoch = progress.epoch + (1 if progress.epoch_done else 0)
        done = cfg.max_steps is not None and progress.step >= cfg.max_steps
        lr, allreduce_bytes = 0.0, 0  # the last step's, for a result read at its epoch's end
        self.stop_signals.install()
        try:
            for epoch in range(first_epoch, cfg.epochs):
                if done:
                    break
                progress.epoch, progress.epoch_done = epoch, False
                if not (resumed_mid_epoch and epoch == first_epoch):
                    self.sampler.set_epoch(epoch)
                while not done:
                    timer.reset(synchronize=self.recorder.logs(progress.step + 1))
                    with timer.phase("data"):
                        global_batch = self.sampler.next_global_batch(self.layout.global_batch())
                    if global_batch is None:
                        break
                    self.profiler.before_step(progress.step + 1)
                    lr, allreduce_bytes = self._train_step(global_batch, timer)
                    progress.step += 1
                    self.profiler.after_step(progress.step)
                    progress.samples += len(global_batch)
                    step = progress.step
                    done = cfg.max_steps is not None and step >= cfg.max_steps
                    evaluate = bool(cfg.eval_every_steps) and step % cfg.eval_every_steps == 0
                    every = self.config.checkpoint.every_steps
                    mid_epoch = not self._epoch_exhausted()  # at an epoch's end the epoch-end checkpoint follows
                    save = mid_epoch and ((bool(every) and step % every == 0) or done)
                    result = None
                    if (evaluate or save or not mid_epoch or self.recorder.is_log_step(step)
                            or self.freezer.needs_statistics() or step % STOP_READ_STEPS == 0):
                        result = self._read_control(lr, allreduce_bytes)
                    self.recorder.step(progress, result, len(global_batch), timer, self.layout.plan,
                                       len(self.freezer.frozen))
                    self._freeze(epoch_end=False)
                    if evaluate:
                        self._validate(started)
                    stop = result is not None and result.stop_requested
                    if stop or save:
                        self._checkpoint(started)
                    if stop:
                        return self._stop(started, signal.SIGINT if result.interrupted else signal.SIGTERM)
                if done and not self._epoch_exhausted():  # max_steps mid-epoch: a resume goes on with this epoch
                    break
                # pending only where the last step's transition grew the global batch past the epoch's rest
                late = self._read_control(lr, allreduce_bytes)
                if not cfg.eval_every_steps:
                    self._validate(started)
                self._freeze(epoch_end=True)  # even on the last step: a checkpoint's policy is the model's state
                progress.epoch_done = True
                self.recorder.epoch_done(self.state.samples_done())
                self._checkpoint(started)
                if late is not None and late.stop_requested:
                    return self._stop(started, signal.SIGINT if late.interrupted else signal.SIGTERM)
            if not progress.eval_history or progress.eval_history[-1]["step"] != progress.step:
                self._validate(started)  # the final model, whatever eval_every_steps is
        finally:
            self.stop_signals.restore()
            self.profiler.close()
            self.recorder.stop()
        return self._finish(started)

    def _train_step(self, global_batch: list[int], timer: StepTimer) -> tuple[float, int]:
        """One optimizer step on ``global_batch``, its control vector left in the ledger; returns what the host knows
        of it: the learning rate and this rank's bytes of gradient sync. Nothing here waits for the device."""
        # Dropout streams depend on (seed, step, rank) only, so a resumed run draws the same masks.
        torch.manual_seed(hash((self.config.seed, self.progress.step, self.env.rank)) % RNG_MODULUS)
        rows = len(global_batch)
        schedule_lr = lr_at(self.state.samples_done() - rows, self._total_samples(), self.config.train, rows)
        lr = schedule_lr * self.layout.lr_scale()
        placement, executor = self.layout.placement, self.layout.executor
        loss_sum, allreduce_bytes = torch.zeros((), dtype=torch.float64, device=self.env.device), 0
        if executor is not None:  # idle ranks only take part in the control vector
            share = placement.share(global_batch)
            with timer.phase("data"):
                batch = executor.load(share)
            if placement.stage == 0:  # one record per replica
                self.recorder.samples(self.progress.epoch, self.progress.step + 1, share)
            if batch is not None:
                loss_sum += executor.forward_backward(batch, rows, timer)
            with timer.phase("allreduce"):
                self.layout.fold_tied_gradients()
                allreduce_bytes = executor.synchronize()
        with timer.phase("control"):
            control = gather_control(self.model, placement, loss_sum, stop=self.stop_signals.received is not None,
                                     interrupt=self.stop_signals.received == signal.SIGINT,
                                     previous_grads=self.freezer.previous_grads,
                                     previous_weights=self.freezer.previous_weights)
        with timer.phase("optimizer"):
            self.optimizer.step(lr, control.total_grad_sq.sqrt())
            self.layout.refresh_tied_weights()
        self.ledger.append(self.progress.step + 1, control)
        return lr, allreduce_bytes

    def _read_control(self, lr: float, allreduce_bytes: int) -> StepResult | None:
        """Read the ledger (one wait for the device) and replay each pending step in order: the finite check (raised
        before anything after the bad step is saved: every save reads first), then the freeze statistics. Returns
        the current step's result (None: nothing pending); a stop request of any pending step stops at this one.
        Every rank reads at the same steps, so every rank takes the same decisions at the same step."""
        pending = self.ledger.read()
        if not pending:
            return None
        stop = interrupted = False
        current = self.progress.step
        for step, control in pending:
            control.check_finite(step, self.checkpointer.directory, read_at=current)
            norms, dots, descents = self.freezer.observe(control)
            stop, interrupted = stop or control.stop_requested, interrupted or control.interrupted
        return StepResult(float(control.loss), lr, allreduce_bytes, norms, dots, descents, stop, interrupted)

    def _freeze(self, epoch_end: bool) -> None:
        record = self.freezer.update(self.progress.step, self.progress.epoch, epoch_end, self.optimizer)
        window = self.freezer.window_record()
        if window is not None:
            self.recorder.event("freeze_window", window)
        if record is not None:
            self.progress.freeze_decisions.append(record)
            self.recorder.event("freeze", record)
            self.layout.follow(self.freezer, self.optimizer, self.progress)

    def _validate(self, started: float) -> None:
        """Evaluate the validation split; keep the weights when they are the best so far."""
        metric, history = self.task.metric, self.progress.eval_history
        best_before = self.task.best(e[metric] for e in history)
        value = self.evaluator.evaluate(self.eval_set, use_cache=True)
        entry = {"epoch": self.progress.epoch, "step": self.progress.step, metric: value,
                 "wall_s": time.perf_counter() - started}
        history.append(entry)
        self.recorder.event("eval", {"split": "validation", "samples": len(self.eval_set), **entry})
        if self.env.is_main:
            logger.info("eval step %d: validation %s %.4f", self.progress.step, metric, value)
        if self.task.better(value, best_before):
            self.checkpointer.save_best(self.model, self.progress.step, metric, value)

    def _checkpoint(self, started: float) -> None:
        record = self.checkpointer.save(self.state, started)
        if record is not None:
            self.progress.checkpoints.append(record)
            self.recorder.checkpoint(record)

    def _stop(self, started: float, signum: signal.Signals) -> dict[str, Any]:
        """A stop request, after its checkpoint: the summary says at which step and by which signal."""
        return self._finish(started, completed=False, interrupted=stop_record(self.progress, signum, self.env.is_main))

    def _finish(self, started: float, completed: bool = True,
                interrupted: dict[str, Any] | None = None) -> dict[str, Any]:
        """The summary; a completed run also evaluates the test split (outside its wall time)."""
        summary = self.recorder.summary(self.progress, time.perf_counter() - started, self.task,
                                        fingerprints=self.layout.fingerprints(),
                                        memory=gather_floats([self.rss_before_model, peak_rss_bytes()]),
                                        freeze_cap_binds=self.freezer.policy.cap_binds, world_size=self.env.world_size)
        summary.update(data_record(self.train_set))
        if interrupted is not None:
            summary["interrupted"] = interrupted
        if self.config.freeze.enabled:
            summary.update(self.freezer.summary(log=self.env.is_main))
        best = self.checkpointer.best()
        self.checkpointer.save_model(self.state, self.run_dir, optimizer=self.config.run.save_model, best=best)
        if completed:
            result, samples = self.evaluator.test(self.test_set, best)
            self.recorder.event("test", {"step": self.progress.step, **result})
            self.recorder.write_test_samples(self.task.metric, samples)
            summary.update(result)
        self.recorder.write_summary(summary)
        return summary

    def _total_samples(self) -> int:
        """The learning-rate schedule's length in samples (a batch growing with the width makes steps unknown)."""
        return len(self.train_set) * self.config.train.epochs

    def _epoch_exhausted(self) -> bool:
        left = self.sampler.remaining()
        return left == 0 or (self.sampler.drop_last and left < self.layout.global_batch())

    def close(self) -> None:
        self.recorder.close()
        self.cache.close()
        self.layout.close()
        shutdown_distributed()


def train(config: Config, task: Task | None = None) -> dict[str, Any]:
    """Python API: run ``config`` in this process (join a torchrun job if launched by one); ``task`` defaults to
    the model's (``task_for``: classification, or next-token prediction for a decoder)."""
    trainer = Trainer(config, task)
    try:
        return trainer.fit()
    finally:
        trainer.close()
