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

A bound callback can also serve the frozen layers' output from the activation cache (``attach(cache=...)``): each
training row carries its index in a column (``idx`` by default, as in GLUE), which ``attach`` keeps through the
Trainer's column removal; the wrapped ``training_step`` takes it out of the batch and runs the step inside
``AutoFreezer.serving``, and the wrapped ``prediction_step`` drops it (evaluation rows are another dataset's).
"""

from __future__ import annotations

import json
import logging
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from pipetransformer.config import CacheConfig, FreezeConfig
from pipetransformer.integrations.freezer import AutoFreezer, sharded_by_fsdp2

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["FROZEN_LAYERS_KEY", "INDEX_COLUMN", "STATE_FILE", "AutoFreezeCallback"]

logger = logging.getLogger(__name__)

FROZEN_LAYERS_KEY = "autofreeze/frozen_layers"
"""The Trainer log entry (``state.log_history``, TensorBoard, ...) with the number of leading layers frozen."""
STATE_FILE = "autofreeze.json"
"""The freezer's state in each Trainer checkpoint folder."""
INDEX_COLUMN = "idx"
"""The training rows' column holding each sample's index, for the activation cache (GLUE datasets' name for it)."""


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
        self.cache: CacheConfig | None = None
        self.cache_max_length: int | None = None

    @classmethod
    def attach(cls, trainer: Trainer, settings: FreezeConfig | None = None, *, seed: int = 0,
               cache: CacheConfig | None = None, cache_max_length: int | None = None,
               index_column: str = INDEX_COLUMN) -> AutoFreezeCallback:
        """Add a callback bound to ``trainer`` (so it reaches the DDP wrapper) and return it.

        ``cache`` (``CacheConfig`` with ``enabled``) serves the frozen layers' output per training sample, as
        :meth:`AutoFreezer.serving` does: the training rows must carry their index in ``index_column`` (distinct,
        from 0 to the training set's size - 1) and be the same every epoch (no random augmentation); for text,
        ``cache_max_length`` is the longest batch in tokens, padded on the right.
        """
        callback = cls(settings, trainer=trainer, seed=seed)
        if cache is not None and cache.enabled:
            callback._serve_from_cache(cache, cache_max_length, index_column)
        trainer.add_callback(callback)
        load_optimizer = trainer._load_optimizer_and_scheduler

        def restore_then_load(checkpoint: str | None) -> None:
            if checkpoint is not None and (Path(checkpoint) / STATE_FILE).is_file():
                callback._restore(Path(checkpoint) / STATE_FILE)
            load_optimizer(checkpoint)

        trainer._load_optimizer_and_scheduler = restore_then_load  # type: ignore[method-assign]
        return callback

    def _serve_from_cache(self, cache: CacheConfig, max_length: int | None, index_column: str) -> None:
        """Keep ``index_column`` in the bound trainer's batches and run each training step inside ``serving``."""
        trainer = self.trainer
        assert trainer is not None
        if trainer.args.torch_compile:
            raise ValueError("the activation cache swaps the frozen layers' forwards for each batch, which a compiled "
                             "model does not follow: set torch_compile=False, or attach without cache=")
        _check_index_column(trainer.train_dataset, index_column)
        self.cache, self.cache_max_length = cache, max_length
        trainer._set_signature_columns_if_needed()  # the columns the Trainer keeps: the model's arguments
        if index_column not in trainer._signature_columns:
            trainer._signature_columns.append(index_column)
        training_step, prediction_step = trainer.training_step, trainer.prediction_step

        def serving_training_step(model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            if index_column not in inputs:
                raise ValueError(f"a training batch has no '{index_column}' column for the activation cache: keep "
                                 "each row's index in it (a custom data_collator must pass it on)")
            indices = inputs.pop(index_column)
            assert self.freezer is not None, "on_train_begin builds the freezer"
            with self.freezer.serving(indices):
                return training_step(model, inputs, *args, **kwargs)

        def prediction_step_without_index(model: nn.Module, inputs: dict[str, Any], *args: Any,
                                          **kwargs: Any) -> Any:
            inputs = {key: value for key, value in inputs.items() if key != index_column}
            return prediction_step(model, inputs, *args, **kwargs)

        trainer.training_step = serving_training_step  # type: ignore[method-assign]
        trainer.prediction_step = prediction_step_without_index  # type: ignore[method-assign]

    def _build(self, model: nn.Module, optimizer: Any, max_steps: int, lr_scheduler: Any) -> None:
        wrapped = self.trainer.model_wrapped if self.trainer is not None else model
        if isinstance(wrapped, DistributedDataParallel):
            target: nn.Module = wrapped
        elif sharded_by_fsdp2(wrapped):  # FSDP2 shards in place (FSDP1 is refused here in one line)
            target = wrapped
        elif dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("under DDP, AutoFreezeCallback must reach the Trainer's DDP wrapper: add it with "
                             "AutoFreezeCallback.attach(trainer) instead of Trainer(callbacks=[...])")
        else:
            target = model
        cache_samples = len(self.trainer.train_dataset) if self.cache is not None and self.trainer else None
        self.freezer = AutoFreezer(target, optimizer, total_steps=max_steps, settings=self.settings, seed=self.seed,
                                   learning_rates=_learning_rates(lr_scheduler, max_steps), cache=self.cache,
                                   cache_samples=cache_samples, cache_max_length=self.cache_max_length)

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
        if self.freezer is None:
            return
        if state.is_world_process_zero:
            logger.info("autofreeze: %s", self.freezer.outcome())
        if self.freezer.cache is not None:
            served = self.freezer.cache
            logger.info("autofreeze: activation cache on this rank: %d samples served, %d advanced, %d computed",
                        served.hits, served.advanced, served.computed)
            self.freezer.close()


def _check_index_column(dataset: Any, column: str) -> None:
    """Refuse, before training, a training set whose rows do not carry a usable sample index in ``column``."""
    fix = (f"give each training row its index in '{column}' (a datasets.Dataset: "
           f"train.map(lambda row, i: {{'{column}': i}}, with_indices=True)) or name the column with index_column=")
    if dataset is None or not hasattr(dataset, "__len__"):
        raise ValueError("AutoFreezeCallback.attach(cache=...) needs a train_dataset with a length (map-style): "
                         "the cache keys each sample's record by its index")
    size = len(dataset)
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list):  # a datasets.Dataset: check the whole column
        if column not in names:
            raise ValueError(f"the training set has no '{column}' column for the activation cache: {fix}")
        values = list(dataset[column])
    else:  # a list of rows: check them all; rows built on the fly: the first
        rows = dataset if isinstance(dataset, list) else [dataset[0]] if size else []
        if not all(isinstance(row, Mapping) and column in row for row in rows):
            raise ValueError(f"the training rows have no '{column}' key for the activation cache: {fix}")
        values = [row[column] for row in rows]
    indices = [_as_index(v) for v in values]
    if any(i is None or not 0 <= i < size for i in indices) or len(set(indices)) != len(indices):
        raise ValueError(f"the training set's '{column}' values must be distinct integers from 0 to {size - 1} "
                         f"(its size - 1) for the activation cache: {fix}")


def _learning_rates(lr_scheduler: Any, max_steps: int) -> list[float] | None:
    """The Trainer's schedule as a factor per step (its schedulers are ``LambdaLR``s), for the freeze policy's
    learning-rate budget; None (a constant rate) for any other scheduler."""
    if not isinstance(lr_scheduler, LambdaLR):
        return None
    factor = lr_scheduler.lr_lambdas[0]
    return [float(factor(step)) for step in range(max_steps)]


def _as_index(value: Any) -> int | None:
    """An integer index (a Python, NumPy or 0-d tensor integer), or None for anything else."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
