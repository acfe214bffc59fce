"""Everything a run must carry over a restart, in one place: checkpoints write it, a resume restores it.

Each piece is ``Stateful`` (``state_dict`` / ``load_state_dict``): the model's blocks, the optimizer (state by
parameter name), the sampler (epoch and position), the freeze policy, the layout's starting width and the
progress (step, histories, checkpoints). Two pieces need none: the learning rate is a pure function of the
samples trained (``optim.lr_at``), and every step reseeds the random streams from (seed, step, rank).
Blocks and optimizer state are gathered to rank 0 the way a layout transition hands them over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from pipetransformer.checkpoint import META_CONFIG_KEY, META_FINGERPRINT_KEY, Checkpoint, model_fingerprint
from pipetransformer.config import Config, config_to_dict
from pipetransformer.data.sampler import ElasticSampler
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.train.autofreeze import AutoFreeze
from pipetransformer.train.elastic import ElasticLayout
from pipetransformer.train.optimizer import HeldOptimizer

__all__ = ["Progress", "TrainState"]


@dataclass
class Progress:
    """Where the run is and what happened so far (the summary's histories)."""

    step: int = 0
    epoch: int = 0
    samples: int = 0
    layout_history: list[dict[str, Any]] = field(default_factory=list)
    eval_history: list[dict[str, Any]] = field(default_factory=list)
    transitions: list[dict[str, Any]] = field(default_factory=list)
    freeze_decisions: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    elapsed_before_s: float = 0.0  # wall time of earlier attempts (before a resume)
    epoch_done: bool = False  # the checkpointed epoch had finished (resume starts the next one)
    restarts: int = 0

    def state_dict(self, elapsed_s: float) -> dict[str, Any]:
        """``elapsed_s``: the run's wall time so far, what a resume starts counting from."""
        return {**dataclasses.asdict(self), "elapsed_before_s": elapsed_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A restored progress is one more restart."""
        restored = Progress(**{**state, "restarts": int(state.get("restarts", 0)) + 1})
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(restored, f.name))
        self.layout_history = list(self.layout_history)


@dataclass(eq=False, kw_only=True)
class TrainState:
    """The run's stateful pieces; ``state_dict`` is a checkpoint's metadata (JSON), ``tensors`` its tensors."""

    model: BlockSequence
    optimizer: HeldOptimizer
    sampler: ElasticSampler
    freezer: AutoFreeze
    layout: ElasticLayout
    progress: Progress
    config: Config

    def samples_done(self) -> int:
        """Samples of the learning-rate schedule before the sampler's position; a finished epoch counts whole, its
        dropped tail (drop_last) included."""
        done = self.progress.epoch_done
        epoch = self.progress.epoch + 1 if done else self.sampler.epoch
        return epoch * self.sampler.num_samples + (0 if done else self.sampler.position)

    def state_dict(self, elapsed_s: float) -> dict[str, Any]:
        return {
            "step": self.progress.step,
            "epoch": self.progress.epoch,
            "sampler": self.sampler.state_dict(),
            "policy": self.freezer.state_dict(),
            "progress": self.progress.state_dict(elapsed_s),
            **self.layout.state_dict(),
            META_CONFIG_KEY: config_to_dict(self.config),
            META_FINGERPRINT_KEY: model_fingerprint(self.model.state_dict()),
        }

    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The layout-independent tensors on rank 0: every block's parameters and persistent buffers, and the
        optimizer state of every trainable parameter, by name (other ranks get empty dicts; all must call)."""
        received = self.layout.gather_to_main(self.optimizer)
        if not self.layout.env.is_main:
            return {}, {}
        weights = {name: tensor.detach().clone().contiguous() for name, tensor in self.model.state_dict().items()}
        return weights, self.optimizer.state_dict(received)

    def load_state_dict(self, checkpoint: Checkpoint) -> None:
        """Restore before the first layout: the optimizer's state is installed as its parameters are held."""
        meta = checkpoint.meta
        with torch.no_grad():
            self.model.load_state_dict(checkpoint.weights)
        self.freezer.load_state_dict(meta["policy"])
        self.sampler.load_state_dict(meta["sampler"])
        self.progress.load_state_dict(meta["progress"])
        self.layout.load_state_dict(meta)
        self.optimizer.load_state_dict(checkpoint.optimizer)
