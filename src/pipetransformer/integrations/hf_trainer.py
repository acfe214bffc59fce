"""AutoFreeze inside the Hugging Face ``Trainer``: a callback that runs :class:`AutoFreezer` at every optimizer step.

The Trainer gives callbacks the unwrapped model and the optimizer but not the DistributedDataParallel wrapper
that Accelerate built (``trainer.model_wrapped``), and that wrapper's reducer must be rebuilt when layers freeze.
So under DDP the callback is bound to its trainer (:meth:`AutoFreezeCallback.attach`); in one process it may
also be passed to ``Trainer(callbacks=[...])`` unbound. It observes at ``on_pre_optimizer_step``: after the
gradients are accumulated, all-reduced and clipped (``max_grad_norm``), before the update.

A bound callback also resumes: it saves its state into each checkpoint folder, and at ``resume_from_checkpoint``
freezes the saved boundary before the Trainer loads the saved optimizer (which holds only the parameters that were
still training); the Trainer offers no callback event there, so ``attach`` wraps the bound trainer's
``_load_optimizer_and_scheduler``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from pipetransformer.config import FreezeConfig
from pipetransformer.integrations.freezer import AutoFreezer

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["FROZEN_LAYERS_KEY", "STATE_FILE", "AutoFreezeCallback"]

logger = logging.getLogger(__name__)

FROZEN_LAYERS_KEY = "autofreeze/frozen_layers"
"""The Trainer log entry (``state.log_history``, TensorBoard, ...) with the number of leading layers frozen."""
STATE_FILE = "autofreeze.json"
"""The freezer's state in each Trainer checkpoint folder."""


class AutoFreezeCallback(TrainerCallback):
    """Freezes the converged leading layers of the Trainer's model while it trains (see :class:`AutoFreezer`).

    ``settings``: ``FreezeConfig`` fields (its defaults otherwise); the decision windows are a share of the
    Trainer's ``max_steps``, and its learning-rate schedule bounds how deep evidence may freeze by each step.
    Each decision, the prior's at step 0 included, is logged through the Trainer (``trainer.log`` when bound, else
    into ``state.log_history``) as :data:`FROZEN_LAYERS_KEY`, and kept in ``decisions``.
    """

    def __init__(self, settings: FreezeConfig | None = None, *, trainer: Trainer | None = None,
                 seed: int = 0) -> None:
        self.settings = settings
        self.trainer = trainer
        self.seed = seed
        self.freezer: AutoFreezer | None = None
        self.decisions: list[dict[str, Any]] = []

    @classmethod
    def attach(cls, trainer: Trainer, settings: FreezeConfig | None = None, *, seed: int = 0) -> AutoFreezeCallback:
        """Add a callback bound to ``trainer`` (so it reaches the DDP wrapper) and return it."""
        callback = cls(settings, trainer=trainer, seed=seed)
        trainer.add_callback(callback)
        load_optimizer = trainer._load_optimizer_and_scheduler

        def restore_then_load(checkpoint: str | None) -> None:
            if checkpoint is not None and (Path(checkpoint) / STATE_FILE).is_file():
                callback._restore(Path(checkpoint) / STATE_FILE)
            load_optimizer(checkpoint)

        trainer._load_optimizer_and_scheduler = restore_then_load  # type: ignore[method-assign]
        return callback

    def _build(self, model: nn.Module, optimizer: Any, max_steps: int, lr_scheduler: Any) -> None:
        wrapped = self.trainer.model_wrapped if self.trainer is not None else model
        if isinstance(wrapped, DistributedDataParallel):
            target: nn.Module = wrapped
        elif dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("under DDP, AutoFreezeCallback must reach the Trainer's DDP wrapper: add it with "
                             "AutoFreezeCallback.attach(trainer) instead of Trainer(callbacks=[...])")
        else:
            target = model
        self.freezer = AutoFreezer(target, optimizer, total_steps=max_steps, settings=self.settings, seed=self.seed,
                                   learning_rates=_learning_rates(lr_scheduler, max_steps))

    def _restore(self, path: Path) -> None:
        """A resumed run: freeze the checkpoint's boundary, so the saved optimizer (without it) loads."""
        assert self.trainer is not None
        self._build(self.trainer.model, self.trainer.optimizer, self.trainer.state.max_steps,
                    self.trainer.lr_scheduler)
        assert self.freezer is not None
        self.freezer.load_state_dict(json.loads(path.read_text()))
        logger.info("autofreeze: resumed with the first %d layers frozen", self.freezer.frozen_layers)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, *,
                       model: nn.Module | None = None, optimizer: Any = None, lr_scheduler: Any = None,
                       **kwargs: Any) -> None:
        if self.freezer is not None:  # restored from a checkpoint
            return
        if model is None or optimizer is None:
            raise ValueError("AutoFreezeCallback needs the Trainer's model and optimizer; use it with a "
                             "transformers Trainer")
        if state.global_step > 0:
            logger.warning("autofreeze: the checkpoint has no %s (bind the callback with AutoFreezeCallback.attach "
                           "to save it): the freeze policy starts afresh at step %d", STATE_FILE, state.global_step)
        self._build(model, optimizer, state.max_steps, lr_scheduler)
        assert self.freezer is not None
        if self.freezer.at_start is not None:  # frozen before the first step (the prior, a schedule's entry at 0)
            self._record(dict(self.freezer.at_start), state)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if self.freezer is not None and state.is_world_process_zero and folder.is_dir():
            (folder / STATE_FILE).write_text(json.dumps(self.freezer.state_dict()))

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        assert self.freezer is not None, "on_train_begin builds the freezer"
        record = self.freezer.step()
        if record is not None:
            self._record(record, state)

    def _record(self, record: dict[str, Any], state: TrainerState) -> None:
        record["global_step"] = state.global_step
        self.decisions.append(record)
        logger.info("autofreeze: step %d, the first %d layers frozen", state.global_step, record["frozen_layers"])
        if self.trainer is not None:  # to every reporter the Trainer has (TensorBoard, ...) and its log history
            self.trainer.log({FROZEN_LAYERS_KEY: float(record["frozen_layers"])})
        else:
            state.log_history.append({FROZEN_LAYERS_KEY: float(record["frozen_layers"]), "step": state.global_step})

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.freezer is not None and state.is_world_process_zero:
            logger.info("autofreeze: %s", self.freezer.outcome())


def _learning_rates(lr_scheduler: Any, max_steps: int) -> list[float] | None:
    """The Trainer's schedule as a factor per step (its schedulers are ``LambdaLR``s), for the freeze policy's
    learning-rate budget; None (a constant rate) for any other scheduler."""
    if not isinstance(lr_scheduler, LambdaLR):
        return None
    factor = lr_scheduler.lr_lambdas[0]
    return [float(factor(step)) for step in range(max_steps)]
