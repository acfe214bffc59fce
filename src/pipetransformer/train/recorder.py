"""What a run leaves for people and tools: the progress bar, ``metrics.jsonl`` (and TensorBoard), the per-rank
sample logs, ``config.yaml``, ``summary.json`` and ``test_samples.json``.

Only rank 0 writes metrics, the config and the summary; with ``run.record_samples`` every rank logs the
sample indices its replica trained on. A resumed run cuts every log back to its checkpoint first, so each
step is recorded once.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pipetransformer.cache.prefix import CacheMetrics
from pipetransformer.config import Config, TrainConfig, config_to_dict
from pipetransformer.data.batch import IndexedDataset
from pipetransformer.distributed import DistEnv
from pipetransformer.metrics import TEST_SAMPLES_FILE, JsonlWriter, MetricsLog, StepTimer, truncate_log, write_json
from pipetransformer.pipe.planner import LayoutPlan
from pipetransformer.train.state import Progress
from pipetransformer.train.step import StepResult
from pipetransformer.train.task import Task

__all__ = ["CONFIG_FILE", "RunRecorder", "SAMPLE_LOG_PREFIX", "SUMMARY_FILE", "bar_samples", "data_record", "stop_record",
           "warn_if_max_steps_out_of_reach"]

logger = logging.getLogger(__name__)

SAMPLE_LOG_PREFIX = "samples-rank"  # + rank + .jsonl (run.record_samples)
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
BAR_REFRESH_S = 1.0


def data_record(train_set: IndexedDataset) -> dict[str, Any]:
    """What a model trained here needs to be used: the class names, in the order of the head's outputs, and for
    images the normalization the pixels were given (``pipetransformer predict`` applies both)."""
    record: dict[str, Any] = {"class_names": list(train_set.class_names)}
    normalization = getattr(train_set, "normalization", None)
    if normalization is not None:
        record["image_normalization"] = {"mean": normalization[0], "std": normalization[1]}
    return record


def bar_samples(schedule_samples: int, max_steps: int | None, global_batch: int) -> int:
    """The progress bar's length: the schedule's samples, or fewer where train.max_steps stops the run first (at
    the starting global batch: a batch that grows with the width ends the bar early)."""
    return schedule_samples if max_steps is None else min(schedule_samples, max_steps * global_batch)


def warn_if_max_steps_out_of_reach(train: TrainConfig, samples: int, global_batch: int, drop_last: bool) -> None:
    """A train.max_steps beyond the steps of train.epochs is never reached: say so before the first step."""
    per_epoch = samples // global_batch if drop_last else math.ceil(samples / global_batch)
    if train.max_steps is not None and train.max_steps > per_epoch * train.epochs:
        logger.warning("train.max_steps=%d is more than the %d steps of train.epochs=%d (%d per epoch): the run "
                       "ends after its epochs; raise train.epochs to train longer", train.max_steps,
                       per_epoch * train.epochs, train.epochs, per_epoch)


def stop_record(progress: Progress, signum: signal.Signals, log: bool) -> dict[str, Any]:
    """A run stopped by a signal after its checkpoint: at which step, by which signal, and that checkpoint."""
    step, checkpoints = progress.step, progress.checkpoints
    checkpoint = checkpoints[-1]["path"] if checkpoints and checkpoints[-1]["step"] == step else None
    if log:
        logger.warning("%s: checkpoint written at step %d, stopping", signum.name, step)
    return {"signal": signum.name, "step": step, "checkpoint": checkpoint}


class RunRecorder:
    def __init__(self, run_dir: Path, config: Config, env: DistEnv, *, resumed_at: int | None,
                 cache_metrics: Callable[[], CacheMetrics | None]) -> None:
        """``resumed_at``: the step of the checkpoint this run resumed from (None: a fresh run). Rank 0 creates
        ``run_dir``: the recorder starts once set-up has succeeded."""
        self.run_dir = run_dir
        if env.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        self.settings = config.run
        self.env = env
        self.cache_metrics = cache_metrics
        append = resumed_at is not None
        if resumed_at is not None:
            self._truncate_sample_logs(resumed_at)
        self.metrics = (MetricsLog(run_dir, append=append, tensorboard=self.settings.tensorboard,
                                   next_step=(resumed_at or 0) + 1) if env.is_main else None)
        self.sample_log = (JsonlWriter(run_dir / f"{SAMPLE_LOG_PREFIX}{env.rank}.jsonl", append)
                           if self.settings.record_samples else None)
        self.started = time.perf_counter()
        self._bar: Any = None
        self._bar_loss = math.nan  # the last loss read from the device

    def write_config(self, config: Config) -> None:
        """Only once set-up succeeded: a bad config never overwrites a run's record."""
        if self.env.is_main:
            (self.run_dir / CONFIG_FILE).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))

    def start(self, started: float, total_samples: int, samples_done: int) -> None:
        """The loop begins (``started`` on the ``perf_counter`` clock, earlier attempts' time included)."""
        self.started = started
        if self.env.is_main and self.settings.progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total_samples, initial=samples_done, unit="samples", dynamic_ncols=True,
                             mininterval=BAR_REFRESH_S)

    def is_log_step(self, step: int) -> bool:
        """Whether ``step`` is a logged one (every ``run.log_every``-th and the first), on any rank: the trainer reads
        the step's numbers from the device then."""
        return step % self.settings.log_every == 0 or step == 1

    def logs(self, step: int) -> bool:
        """Whether ``step``'s record is written (a log step, on rank 0)."""
        return self.metrics is not None and self.is_log_step(step)

    def step(self, progress: Progress, result: StepResult | None, samples: int, timer: StepTimer, plan: LayoutPlan,
             frozen_layers: int) -> None:
        """``result``: the step's numbers where the trainer read them (always on a log step), else None: the bar
        moves and keeps the last loss it was shown."""
        step_s = timer.total()
        layout = plan.layout
        if result is not None:
            self._bar_loss = result.loss
        if self._bar is not None:
            self._bar.update(samples)
            self._bar.set_postfix_str(f"loss {self._bar_loss:.3f} | {samples / step_s:.1f} samples/s | frozen "
                                      f"{frozen_layers} | stages {layout.num_stages} x dp {layout.dp_width}")
        if result is None or not self.logs(progress.step):
            return
        record = {"step": progress.step, "epoch": progress.epoch, "loss": result.loss, "lr": result.lr,
                  "samples_per_s": samples / step_s, "step_s": step_s, "global_batch": samples,
                  "frozen_layers": frozen_layers, "stages": layout.num_stages, "dp_width": layout.dp_width,
                  "micro_batches": plan.micro_batches, "allreduce_bytes": result.allreduce_bytes,
                  "layer_grad_norms": result.layer_grad_norms, "wall_s": time.perf_counter() - self.started,
                  **timer.as_record()}
        if result.layer_grad_dots is not None:
            record["layer_grad_dots"] = result.layer_grad_dots
        if result.layer_descents is not None:
            record["layer_descents"] = result.layer_descents
        cache = self.cache_metrics()
        if cache is not None:
            record.update({"cache_hit_rate": cache.hit_rate, "cache_memory_bytes": cache.memory_used_bytes,
                           "cache_disk_bytes": cache.disk_used_bytes, "cache_seconds_saved": cache.seconds_saved})
        self.event("step", record)

    def samples(self, epoch: int, step: int, indices: list[int]) -> None:
        """The sample indices a replica trains on in ``step`` (one record per replica: its stage 0 calls)."""
        if self.sample_log is not None:
            self.sample_log.write({"epoch": epoch, "step": step, "indices": indices})

    def event(self, kind: str, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write({"event": kind, **record})

    def checkpoint(self, record: dict[str, Any]) -> None:
        """The events up to a checkpoint survive a kill; a resume continues from here."""
        self.event("checkpoint", record)
        if self.metrics is not None:
            self.metrics.flush()

    def epoch_done(self, samples_done: int) -> None:
        if self._bar is not None:
            self._bar.update(samples_done - self._bar.n)  # a dropped tail counts as done

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def summary(self, progress: Progress, wall_s: float, task: Task, *, fingerprints: list[list[float]],
                memory: list[list[float]], freeze_cap_binds: int, world_size: int) -> dict[str, Any]:
        """``memory``: per rank, the peak resident bytes before the model was built and over the whole run."""
        metric = task.metric
        evals = progress.eval_history
        return {
            "rank_fingerprints": fingerprints,
            "rss_before_model_bytes": [int(before) for before, _ in memory],
            "peak_rss_bytes": [int(peak) for _, peak in memory],
            f"eval_{metric}": evals[-1][metric] if evals else None,
            f"best_eval_{metric}": task.best(e[metric] for e in evals),
            "eval_history": evals,
            "wall_time_s": wall_s,
            "train_samples": progress.samples,
            "steps": progress.step,
            "world_size": world_size,
            "layout_history": progress.layout_history,
            "transitions": progress.transitions,
            "freeze_decisions": progress.freeze_decisions,
            "freeze_cap_binds": freeze_cap_binds,
            "samples_per_s": progress.samples / wall_s if wall_s > 0 else None,
            "restarts": progress.restarts,
            "checkpoints": progress.checkpoints,
            "run_dir": str(self.run_dir),
        }

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.env.is_main:
            write_json(self.run_dir / SUMMARY_FILE, summary)

    def write_test_samples(self, metric: str, samples: dict[str, list[float] | None]) -> None:
        """Each test sample's metric (``final`` model, ``at_best_validation``): runs scored on the same test split
        pair up sample by sample (``pipetransformer report``)."""
        if self.env.is_main:
            write_json(self.run_dir / TEST_SAMPLES_FILE, {"metric": metric, **samples}, indent=None)

    def close(self) -> None:
        self.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.sample_log is not None:
            self.sample_log.close()

    def _truncate_sample_logs(self, step: int) -> None:
        """Cut each rank's sample log back to the checkpoint (the rank's own, and rank 0 those of ranks this run
        no longer has), so a step the killed attempt trained after it is recorded once."""
        for path in self.run_dir.glob(f"{SAMPLE_LOG_PREFIX}*.jsonl"):
            rank = int(path.stem.removeprefix(SAMPLE_LOG_PREFIX))
            if rank == self.env.rank or (self.env.is_main and rank >= self.env.world_size):
                truncate_log(path, step)
