"""When a run's state goes to disk and comes back, so that every rank agrees on the outcome.

Rank 0 alone writes and reads files (``checkpoint`` does the format: safetensors + a verified manifest);
every rank calls every method, and a failure on rank 0 makes every rank raise the same one-line
``CheckpointError`` (``distributed.raise_together``) instead of leaving the others in a collective until
``dist.timeout_s``. Also keeps the weights of the best validation so far, for one test at the end.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any


from pipetransformer.checkpoint import (CHECKPOINTS_DIR, Checkpoint, CheckpointError, check_compatible,
                                        latest_valid_checkpoint, load_checkpoint, model_fingerprint, save_checkpoint,
                                        write_tensors)
from pipetransformer.config import RESUME_AUTO, CheckpointConfig, config_to_dict
from pipetransformer.distributed import DistEnv, broadcast_string, broadcast_tensors, raise_together
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.train.state import TrainState

__all__ = ["BEST_MODEL_FILE", "BEST_VALIDATION_DIR", "CHECKPOINTS_DIR", "Checkpointer", "MODEL_FILE", "OPTIMIZER_FILE"]

logger = logging.getLogger(__name__)

BEST_VALIDATION_DIR = "best-validation"
"""Under the checkpoint directory: the weights of the best validation metric, tested once at the end."""
MODEL_FILE = "model.safetensors"
"""In the run directory: the final weights (or those at an interrupt), always written."""
BEST_MODEL_FILE = "best-validation.safetensors"
"""In the run directory: the weights of the best validation, when checkpoints (which keep them) are on."""
OPTIMIZER_FILE = "optimizer.safetensors"


class Checkpointer:
    def __init__(self, settings: CheckpointConfig, run_dir: Path, env: DistEnv) -> None:
        self.settings = settings
        self.directory = Path(settings.dir or run_dir / CHECKPOINTS_DIR)
        self.env = env

    def resume(self, state: TrainState) -> bool:
        """Restore ``state`` from ``checkpoint.resume`` (the same checkpoint on every rank); False if there is none.

        Rank 0 alone reads and verifies it and hands it to the others; a checkpoint that cannot be read or
        used makes every rank raise the same CheckpointError.
        """
        resume = self.settings.resume
        if resume is None:
            return False
        checkpoint, error = None, ""
        if self.env.is_main:
            try:
                checkpoint = (latest_valid_checkpoint(self.directory) if resume == RESUME_AUTO
                              else load_checkpoint(Path(resume)))
            except CheckpointError as failure:
                error = str(failure)
        raise_together(error, CheckpointError)
        path = broadcast_string(str(checkpoint.path) if checkpoint is not None else "")
        if not path:
            logger.info("no checkpoint in %s: starting from scratch", self.directory)
            return False
        meta = json.loads(broadcast_string(json.dumps(checkpoint.meta) if checkpoint is not None else ""))
        error = ""
        try:  # on every rank: its own model and config
            check_compatible(meta, model_fingerprint=model_fingerprint(state.model.state_dict()),
                             config=config_to_dict(state.config))
        except CheckpointError as failure:
            error = str(failure)
        raise_together(error, CheckpointError)
        weights = broadcast_tensors(checkpoint.weights if checkpoint is not None else None)
        optimizer = broadcast_tensors(checkpoint.optimizer if checkpoint is not None else None)
        state.load_state_dict(Checkpoint(Path(path), int(meta["step"]), weights, optimizer, meta))
        logger.info("resumed from %s (step %d, epoch %d)", path, state.progress.step, state.progress.epoch)
        return True

    def save(self, state: TrainState, started: float) -> dict[str, Any] | None:
        """Gather the layout-independent state on rank 0 and write it atomically; returns the checkpoint's record
        (None when checkpoints are off). ``started``: the run's start on the ``perf_counter`` clock."""
        if not self.settings.enabled:
            return None
        weights, optimizer = state.tensors()
        saved, error = None, ""
        if self.env.is_main:
            try:
                saved = save_checkpoint(self.directory, state.progress.step, weights, optimizer,
                                        state.state_dict(time.perf_counter() - started), keep=self.settings.keep)
            except CheckpointError as failure:
                error = str(failure)
        raise_together(error, CheckpointError)
        if saved is None:
            return None
        return {"step": saved.step, "bytes": saved.bytes_written, "seconds": saved.seconds, "path": str(saved.path)}

    def save_model(self, state: TrainState, directory: Path, *, optimizer: bool, best: Checkpoint | None) -> None:
        """Every block's weights, the best validation's (``best``, if kept) and, with ``optimizer``, all optimizer
        state, written as checkpoint files are: what ``pipetransformer predict`` and ``export`` read."""
        weights, optimizer_state = state.tensors()
        error = ""
        if self.env.is_main:
            try:
                write_tensors(directory / MODEL_FILE, weights, "model")
                if best is not None:
                    write_tensors(directory / BEST_MODEL_FILE, best.weights, "model")
                if optimizer:
                    write_tensors(directory / OPTIMIZER_FILE, optimizer_state, "optimizer")
            except CheckpointError as failure:
                error = str(failure)
        raise_together(error, CheckpointError)

    def save_best(self, model: BlockSequence, step: int, metric: str, value: float) -> None:
        """Keep the weights of the best validation so far (with checkpoints on). An evaluation has just given every
        rank the whole current model, so rank 0 writes it alone; a failed write stops every rank with its message."""
        if not self.settings.enabled:
            return
        error = ""
        if self.env.is_main:
            weights = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
            try:
                save_checkpoint(self.directory / BEST_VALIDATION_DIR, step, weights, {},
                                {f"validation_{metric}": value}, keep=1)
            except CheckpointError as failure:
                error = str(failure)
        raise_together(error, CheckpointError)

    def best(self) -> Checkpoint | None:
        """The best-validation weights, if kept: rank 0 reads them and hands them to the others, so every rank
        tests the same weights or none does."""
        if not self.settings.enabled:
            return None
        found = latest_valid_checkpoint(self.directory / BEST_VALIDATION_DIR) if self.env.is_main else None
        step = int(broadcast_string(str(found.step) if found is not None else "-1"))
        if step < 0:
            return None
        weights = broadcast_tensors(found.weights if found is not None else None)
        return Checkpoint(self.directory / BEST_VALIDATION_DIR, step, weights, {}, found.meta if found else {})
