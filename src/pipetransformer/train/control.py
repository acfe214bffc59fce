"""The per-step control vector: what every rank must agree on after a step, in one all-reduce on the device, and the
ledger that holds it there until the host needs it.

Per-layer gradient statistics (for the freeze policy), the total gradient norm (for clipping), stop requests
(SIGTERM or SIGINT on any rank) and the loss travel together as one float64 tensor summed over the world, so every rank,
idle ones included, takes the same freeze, clip and stop decisions. Each field is contributed by exactly one
kind of rank, so the sum assembles them: the gradient norms come from replica 0 of each stage, each block's dot
products and descents from one replica of its stage (:func:`replica_share`: they split the freezer's work), the loss
from the last stages. After the gradient sync every replica holds the same gradients and weights: measuring a block on
more than one would scale its statistics by the width. Norms travel squared, so stages holding different layers simply
add up.

The vector is made, summed and used (the clip) on the training device. Reading it on the host waits for a GPU, so the
trainer appends each step's vector to a :class:`ControlLedger` and reads the ledger in one copy at the steps whose
decisions need it (a logged step, a freeze decision, a checkpoint, an evaluation, an epoch's end): the numbers of every
step reach the policy and the checks in order, only later.
"""

from __future__ import annotations

import math
import signal
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetransformer.freeze.apply import (PreviousGradients, PreviousWeights, block_grad_sq_norms, device_constant,
                                          replica_share)
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.train.elastic import Placement

__all__ = ["STOP_SIGNALS", "ControlLedger", "ControlVector", "StopSignals", "TrainingDivergedError", "gather_control"]

DEVICE_FIELDS = {"layer_grad_sq": True, "layer_grad_dots": True, "layer_descents": True, "total_grad_sq": False,
                 "loss": False}
"""The fields computed on the device, in the packed order; True: one value per transformer layer, else one."""
HOST_FIELDS = {"layer_dot_valid": True, "layer_descent_valid": True, "stop_requests": False,
               "interrupt_requests": False}
"""The fields the host knows (which statistics are valid, stop requests), packed after the device's: they reach the
device as one cached constant (``freeze.apply.device_constant``), not a copy a step."""


class TrainingDivergedError(RuntimeError):
    """Loss or gradients became NaN/inf; the message names the step and layer."""


class ControlVector:
    """One step's control fields, each a view of one packed float64 tensor (what the all-reduce sums).

    - ``layer_grad_sq`` [L]: squared gradient norm of each transformer layer
    - ``layer_grad_dots`` [L]: g_t . g_{t-1} of each layer (0 where not valid)
    - ``layer_descents`` [L]: -g_t . (w_t - w_{t-1}) of each layer, layer 0's with the embeddings' (0 where not valid)
    - ``total_grad_sq`` [1]: squared norm of every trainable gradient (embeddings and head included)
    - ``loss`` [1]: the step's loss summed over the last stages (already a mean over the global batch)
    - ``layer_dot_valid`` [L], ``layer_descent_valid`` [L]: 1 where the layer's dot product / descent is valid
    - ``stop_requests`` [1]: ranks that received SIGTERM or SIGINT
    - ``interrupt_requests`` [1]: ranks whose stop request was a SIGINT (Ctrl-C): the run exits 130
    """

    def __init__(self, packed: torch.Tensor, num_layers: int) -> None:
        self.packed = packed
        self.num_layers = num_layers
        names = [*DEVICE_FIELDS, *HOST_FIELDS]
        sizes = [num_layers if per_layer else 1 for per_layer in (*DEVICE_FIELDS.values(), *HOST_FIELDS.values())]
        for name, view in zip(names, torch.split(packed, sizes)):
            setattr(self, name, view)
        self._host_start = sum(sizes[:len(DEVICE_FIELDS)])

    layer_grad_sq: torch.Tensor
    layer_grad_dots: torch.Tensor
    layer_descents: torch.Tensor
    total_grad_sq: torch.Tensor
    loss: torch.Tensor
    layer_dot_valid: torch.Tensor
    layer_descent_valid: torch.Tensor
    stop_requests: torch.Tensor
    interrupt_requests: torch.Tensor

    @staticmethod
    def width(num_layers: int) -> int:
        return sum(num_layers if per_layer else 1 for per_layer in (*DEVICE_FIELDS.values(), *HOST_FIELDS.values()))

    @classmethod
    def zeros(cls, num_layers: int, device: torch.device | None = None) -> ControlVector:
        return cls(torch.zeros(cls.width(num_layers), dtype=torch.float64, device=device), num_layers)

    def set_host_fields(self, dot_valid: torch.Tensor, descent_valid: torch.Tensor, *, stop: bool,
                        interrupt: bool) -> None:
        """The host's fields (``[L]`` CPU tensors, and the flags) in one copy of a cached device constant."""
        values = (*dot_valid.tolist(), *descent_valid.tolist(), float(stop or interrupt), float(interrupt))
        self.packed[self._host_start:].copy_(device_constant(values, self.packed.device))

    def all_reduce(self, device: torch.device | None = None) -> ControlVector:
        """Sum the vector over the default group, in place, in one collective (on ``device`` when given: a user's
        NCCL-only group cannot reduce CPU tensors); returns the summed vector, on the device it was reduced on."""
        packed = self.packed if device is None else self.packed.to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed)
        return self if packed is self.packed else ControlVector(packed, self.num_layers)

    def cpu(self) -> ControlVector:
        """The vector on the host (a wait for the device: the ledger reads many steps' in one)."""
        return ControlVector(self.packed.cpu(), self.num_layers)

    # What the host reads (call on a host vector: each value of a device one is a wait).

    def layer_grad_norms(self) -> list[float]:
        return [v ** 0.5 for v in self.layer_grad_sq.tolist()]

    def layer_dots(self) -> list[float | None]:
        """Per layer, the dot product where it is valid, else None."""
        return [d if v > 0 else None for d, v in zip(self.layer_grad_dots.tolist(), self.layer_dot_valid.tolist())]

    def descents(self) -> list[float | None]:
        """Per layer, the descent where it is valid, else None."""
        return [d if v > 0 else None for d, v in zip(self.layer_descents.tolist(), self.layer_descent_valid.tolist())]

    def total_grad_norm(self) -> float:
        return math.sqrt(float(self.total_grad_sq))

    @property
    def stop_requested(self) -> bool:
        return bool(self.stop_requests > 0)

    @property
    def interrupted(self) -> bool:
        """Some rank's stop request was a SIGINT: every rank reports the stop as an interruption."""
        return bool(self.interrupt_requests > 0)

    def check_finite(self, step: int, checkpoint_dir: Path, *, read_at: int | None = None) -> None:
        """Raise at a non-finite step, before anything after it is saved: the last checkpoint stays the last good one.
        ``read_at``: the step the host read this vector at (later than ``step`` when the ledger held it)."""
        loss, total_norm = float(self.loss), self.total_grad_norm()
        if math.isfinite(loss) and math.isfinite(total_norm):
            return
        bad = [i for i, v in enumerate(self.layer_grad_sq.tolist()) if not math.isfinite(v)]
        where = f"first in layer_{bad[0]}" if bad else "in the embeddings or head"
        stopped = "" if read_at is None or read_at == step else f" (read at step {read_at})"
        raise TrainingDivergedError(
            f"non-finite loss ({loss}) or gradient norm ({total_norm}) at step {step}, {where}{stopped}; "
            f"nothing after step {step - 1} was saved; lower train.lr or set train.grad_clip, then resume from "
            f"{checkpoint_dir}")


def gather_control(model: BlockSequence, placement: Placement, loss_sum: torch.Tensor, *, stop: bool,
                   previous_grads: PreviousGradients | None, previous_weights: PreviousWeights | None = None,
                   interrupt: bool = False) -> ControlVector:
    """This rank's share of the step's control vector, summed over the world (every rank must call), on
    ``loss_sum``'s device, read by nothing on the host. ``interrupt``: this rank's stop request came from SIGINT."""
    layers = model.num_layers
    control = ControlVector.zeros(layers, loss_sum.device)
    dot_valid = torch.zeros(layers, dtype=torch.float64)  # the host's fields, on the host
    descent_valid = torch.zeros(layers, dtype=torch.float64)
    if placement.replica == 0:
        blocks = block_grad_sq_norms(model, range(*placement.blocks))
        control.layer_grad_sq.copy_(blocks[1:layers + 1])
        control.total_grad_sq.copy_(blocks.sum())
    if placement.replica is not None:  # the freezer's statistics: the stage's replicas measure a share of it each
        start, end = placement.blocks
        width, replica = placement.plan.layout.dp_width, placement.replica
        if previous_grads is not None:  # layer blocks only: the policy reads no embeddings or head dots
            layer_blocks = replica_share(range(max(start, 1), min(end, layers + 1)), width, replica)
            dots, valid = previous_grads.block_dots(model, layer_blocks)
            control.layer_grad_dots.copy_(dots[1:layers + 1])
            dot_valid = valid[1:layers + 1]
        if previous_weights is not None:  # the embeddings too: their descent counts in layer 0's
            measured = replica_share(range(start, min(end, layers + 1)), width, replica)
            descents, valid = previous_weights.block_descents(model, measured)
            control.layer_descents.copy_(descents[1:layers + 1])
            control.layer_descents[:1] += descents[:1]
            descent_valid = valid[1:layers + 1].clone()
            embeddings_train = 0 in measured and any(p.requires_grad for p in model.blocks[0].parameters())
            if embeddings_train and valid.tolist()[0] == 0:  # valid lives on the host: no wait
                # the embeddings train but had no previous step here: this rank vetoes layer 0's descent for this step
                # (-1 in the sum of valid flags, which may come from the rank measuring layer 0)
                descent_valid[0] = -1.0
    if placement.last_stage:
        control.loss.copy_(loss_sum)
    control.set_host_fields(dot_valid, descent_valid, stop=stop, interrupt=interrupt)
    return control.all_reduce()


class ControlLedger:
    """The control vectors of the steps the host has not read yet, on the device, read in one copy.

    Every rank appends the same steps' (all-reduced) vectors and the trainer reads at the same steps on every rank, so
    whatever the host then decides from them (stop, freeze, diverged) it decides at the same step everywhere.
    """

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._vectors: list[ControlVector] = []

    def __len__(self) -> int:
        return len(self._steps)

    def append(self, step: int, control: ControlVector) -> None:
        self._steps.append(step)
        self._vectors.append(control)

    def read(self) -> list[tuple[int, ControlVector]]:
        """Every unread step's vector on the host, in step order (one copy for them all), and the ledger empties."""
        if not self._steps:
            return []
        num_layers = self._vectors[0].num_layers
        rows = torch.stack([control.packed for control in self._vectors]).cpu()
        read = [(step, ControlVector(row, num_layers)) for step, row in zip(self._steps, rows)]
        self._steps, self._vectors = [], []
        return read


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
