"""The trainer that composes the four automations, and its components, one concern per module.

``trainer`` (the loop), ``task`` (loss and metric), ``step`` (forward/backward on one stage or a pipeline),
``control`` (what every rank agrees on after a step), ``optimizer`` (the held parameters' optimizer),
``autofreeze`` (AutoFreeze), ``elastic`` (AutoPipe + AutoDP: layout and transitions), ``autocache``
(AutoCache), ``evaluator``, ``state`` and ``checkpointer`` (what survives a restart), ``recorder`` (logs and
summary), ``build`` (data splits and model from a config).
"""

from __future__ import annotations

from pipetransformer.train.control import TrainingDivergedError
from pipetransformer.train.task import Task, classification, regression
from pipetransformer.train.trainer import Trainer, train

__all__ = ["Task", "Trainer", "TrainingDivergedError", "classification", "regression", "train"]
