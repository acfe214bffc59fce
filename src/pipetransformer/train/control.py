"""The per-step control vector: what every rank must agree on after a step, in one all-reduce.

Per-layer gradient statistics (for the freeze policy), the total gradient norm (for clipping), stop requests
(SIGTERM or SIGINT on any rank) and the loss travel together as one float64 tensor summed over the world, so every rank,
idle ones included, takes the same freeze, clip and stop decisions. Each field is contributed by exactly one
kind of rank (gradients by replica 0 of each stage, the loss by the last stages), so the sum assembles them.
Gradients count from replica 0 only because after the gradient sync every replica holds the same ones:
summing them too would scale the statistics by the width. Norms travel squared, so stages holding
different layers simply add up.
"""

from __future__ import annotations

import math
import signal
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetransformer.freeze.apply import PreviousGradients, PreviousWeights, block_grad_sq_norms
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.train.elastic import Placement

__all__ = ["STOP_SIGNALS", "ControlVector", "StopSignals", "TrainingDivergedError", "gather_control"]


class TrainingDivergedError(RuntimeError):
    """Loss or gradients became NaN/inf; the message names the step and layer."""


@dataclass
class ControlVector:
    layer_grad_sq: torch.Tensor  # [L] squared gradient norm of each transformer layer
    layer_grad_dots: torch.Tensor  # [L] g_t . g_{t-1} of each layer (0 where not valid)
    layer_dot_valid: torch.Tensor  # [L] 1 where the layer's dot product is valid
    layer_descents: torch.Tensor  # [L] -g_t . (w_t - w_{t-1}) of each layer, layer 0's with the embeddings' (0 where not valid)
    layer_descent_valid: torch.Tensor  # [L] 1 where the layer's descent is valid
    total_grad_sq: torch.Tensor  # [1] squared norm of every trainable gradient (embeddings and head included)
    stop_requests: torch.Tensor  # [1] ranks that received SIGTERM or SIGINT
    interrupt_requests: torch.Tensor  # [1] ranks whose stop request was a SIGINT (Ctrl-C): the run exits 130
    loss: torch.Tensor  # [1] the step's loss summed over the last stages (already a mean over the global batch)

    @classmethod
    def zeros(cls, num_layers: int) -> ControlVector:
        shapes = {name: num_layers for name in ("layer_grad_sq", "layer_grad_dots", "layer_dot_valid", "layer_descents",
                                                "layer_descent_valid")}
        return cls(**{f.name: torch.zeros(shapes.get(f.name, 1), dtype=torch.float64) for f in fields(cls)})

    def all_reduce(self, device: torch.device | None = None) -> ControlVector:
        """Sum every field over the default group (one collective, on ``device`` when given: a user's NCCL-only
        group cannot reduce CPU tensors; the trainer's group has gloo for them); returns the summed vector, on CPU."""
        parts = [getattr(self, f.name) for f in fields(self)]
        packed = torch.cat(parts)
        if dist.is_initialized() and dist.get_world_size() > 1:
            on_device = packed.to(device) if device is not None else packed
            dist.all_reduce(on_device)
            packed = on_device.cpu()
        return ControlVector(*torch.split(packed, [p.numel() for p in parts]))

    def layer_grad_norms(self) -> list[float]:
        return [float(v) ** 0.5 for v in self.layer_grad_sq]

    def layer_dots(self) -> list[float | None]:
        """Per layer, the dot product where it is valid, else None."""
        return [float(d) if v > 0 else None for d, v in zip(self.layer_grad_dots, self.layer_dot_valid)]

    def descents(self) -> list[float | None]:
        """Per layer, the descent where it is valid, else None."""
        return [float(d) if v > 0 else None for d, v in zip(self.layer_descents, self.layer_descent_valid)]

    def set_descents(self, block_descents: torch.Tensor, block_valid: torch.Tensor, num_layers: int, *,
                     embeddings_incomplete: bool) -> None:
        """This rank's per-block descents (embeddings, layers, head) as the policy reads them: layer 0's counts the
        embeddings, which freeze with it. ``embeddings_incomplete``: this rank's embeddings train but had no previous
        step, so it vetoes layer 0's descent for this step (-1 in the sum of valid flags, which may come from the
        rank holding layer 0)."""
        self.layer_descents[:] = block_descents[1:num_layers + 1]
        self.layer_descents[0] += block_descents[0]
        self.layer_descent_valid[:] = block_valid[1:num_layers + 1]
        if embeddings_incomplete:
            self.layer_descent_valid[0] = -1.0

    def total_grad_norm(self) -> float:
        return math.sqrt(float(self.total_grad_sq))

    @property
    def stop_requested(self) -> bool:
        return bool(self.stop_requests > 0)

    @property
    def interrupted(self) -> bool:
        """Some rank's stop request was a SIGINT: every rank reports the stop as an interruption."""
        return bool(self.interrupt_requests > 0)

    def check_finite(self, step: int, checkpoint_dir: Path) -> None:
        """Stop before a non-finite update reaches the weights; the last checkpoint stays the last good one."""
        loss, total_norm = float(self.loss), self.total_grad_norm()
        if math.isfinite(loss) and math.isfinite(total_norm):
            return
        bad = [i for i, v in enumerate(self.layer_grad_sq.tolist()) if not math.isfinite(v)]
        where = f"first in layer_{bad[0]}" if bad else "in the embeddings or head"
        raise TrainingDivergedError(
            f"non-finite loss ({loss}) or gradient norm ({total_norm}) at step {step}, {where}; "
            f"no update was applied; lower train.lr or set train.grad_clip, then resume from {checkpoint_dir}")


def gather_control(model: BlockSequence, placement: Placement, loss_sum: torch.Tensor, *, stop: bool,
                   previous_grads: PreviousGradients | None, previous_weights: PreviousWeights | None = None,
                   interrupt: bool = False) -> ControlVector:
    """This rank's share of the step's control vector, summed over the world (every rank must call).
    ``interrupt``: this rank's stop request came from SIGINT."""
    layers = model.num_layers
    control = ControlVector.zeros(layers)
    control.stop_requests[0] = float(stop or interrupt)
    control.interrupt_requests[0] = float(interrupt)
    if placement.replica == 0:
        blocks = block_grad_sq_norms(model, range(*placement.blocks))
        control.layer_grad_sq[:] = blocks[1:layers + 1]
        control.total_grad_sq[0] = blocks.sum()
        if previous_grads is not None:
            start, end = placement.blocks  # layer blocks only: the policy reads no embeddings or head dots
            dots, valid = previous_grads.block_dots(model, range(max(start, 1), min(end, layers + 1)))
            control.layer_grad_dots[:] = dots[1:layers + 1]
            control.layer_dot_valid[:] = valid[1:layers + 1]
        if previous_weights is not None:  # the embeddings too: their descent counts in layer 0's
            start, end = placement.blocks
            descents, valid = previous_weights.block_descents(model, range(start, min(end, layers + 1)))
            embeddings_train = start == 0 and any(p.requires_grad for p in model.blocks[0].parameters())
            control.set_descents(descents, valid, layers, embeddings_incomplete=embeddings_train and valid[0] == 0)
    if placement.last_stage:
        control.loss[0] = loss_sum
    return control.all_reduce()


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""Each checkpoints at the next step and stops the run; SIGINT (Ctrl-C) makes the command exit 130."""


class StopSignals:
    """This rank's SIGTERM / SIGINT, recorded by a handler at any moment and acted on through the control vector.

    Only a request: the ranks agree on the step through the next control vector. Acting on it in the handler
    would let a signal that lands between a step's control all-reduce and the stop check stop this rank one step
    before the others, which then wait for it until the timeout. A second Ctrl-C on a lone process stops it at
    once (KeyboardInterrupt); workers of a launcher may get each Ctrl-C twice (from the terminal and forwarded by
    the launcher), so there the launcher decides when to stop hard.
    """

    def __init__(self, *, lone_process: bool) -> None:
        self.lone_process = lone_process
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        """Handle the stop signals (only the main thread can set handlers; elsewhere nothing is installed)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT and self.lone_process:
            raise KeyboardInterrupt
        if self.received != signal.SIGINT:  # an interrupt is what the user sees, whatever came first
            self.received = signal.Signals(signum)
