"""The optimizer over the trainable parameters this rank holds: the one place that names and moves its state.

A freeze or a layout transition changes which parameters a rank trains, so the optimizer is rebuilt over
the new set, and every parameter keeps its state (Adam's moments and step count): the rank's own if it
held the parameter, the state its previous owner sent (``dp.handover``) if it moved here, or, at a
resume, the checkpoint's. Outside the process state is keyed ``"<parameter name>.<state key>"``: layout-
independent, so a run may resume on another worker count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pipetransformer.config import TrainConfig
from pipetransformer.dp.handover import place_state, state_tensors
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.optim import build_optimizer, layer_lr_scales, set_lr

__all__ = ["CLIP_EPSILON", "HeldOptimizer", "OptimizerState"]

CLIP_EPSILON = 1e-6  # as torch.nn.utils.clip_grad_norm_

OptimizerState = Mapping[nn.Parameter, dict[str, Any]]
"""Per parameter, its state as the optimizer keeps it (what a handover sends and receives)."""


class HeldOptimizer:
    """AdamW or SGD over the trainable parameters of the blocks this rank holds (``None`` while it holds none)."""

    def __init__(self, model: BlockSequence, settings: TrainConfig) -> None:
        self.model = model
        self.settings = settings
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[nn.Parameter] = []
        self._lr_scales = layer_lr_scales(len(model), settings.layer_lr_decay)
        self._built = False
        self._restored: dict[str, dict[str, torch.Tensor]] = {}  # a checkpoint's, until its parameters are held

    @property
    def state(self) -> OptimizerState:
        return self.optimizer.state if self.optimizer is not None else {}

    def rebuild(self, blocks: tuple[int, int], received: OptimizerState) -> None:
        """Optimize the trainable parameters of blocks ``[start, end)`` from now on, each with its block's learning
        rate scale (from its place in the whole model, not the stage) and the state it had anywhere."""
        start, end = blocks
        mirrors = self.model.mirrors()  # a tied weight is trained at its owner only
        params = [p for i in range(start, end) for p in self.model.blocks[i].parameters()
                  if p.requires_grad and p not in mirrors]
        scales = {p: self._lr_scales[i] for i in range(start, end) for p in self.model.blocks[i].parameters()}
        old_state = self.state
        self.optimizer = build_optimizer(params, self.settings, scales) if params else None
        self.params = params
        if self.optimizer is not None:
            for param in params:
                if param in received:
                    self.optimizer.state[param] = received[param]
                elif param in old_state and old_state[param]:
                    self.optimizer.state[param] = old_state[param]
        self._built = True
        self._install_restored()

    def step(self, lr: float, total_grad_norm: torch.Tensor | float) -> None:
        """Clip to ``train.grad_clip`` by the gradient norm of the whole model (from the control vector: a tensor on
        the device, so the clip reads nothing on the host, as ``clip_grad_norm_``), set the rate, update, and clear
        the gradients."""
        if self.optimizer is None:
            return
        clip = self.settings.grad_clip
        grads = [p.grad for p in self.params if p.grad is not None]
        if clip is not None and grads:
            # a coefficient of 1 (a norm within the clip, or 0) multiplies every gradient by exactly 1: no change; in
            # the gradients' dtype, as a Python float would be (the fused kernel wants the scalar's dtype and device)
            norm = torch.as_tensor(total_grad_norm, dtype=torch.float64, device=grads[0].device).reshape(())
            coef = (clip / (norm + CLIP_EPSILON)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self, received: OptimizerState | None = None) -> dict[str, torch.Tensor]:
        """The state of every trainable parameter this rank has, its own or ``received`` from the others (a
        checkpoint gathers them on rank 0), by ``"<parameter name>.<state key>"``."""
        received = received or {}
        own = self.state
        tensors = {}
        for name, param in self.model.named_parameters():
            state = received.get(param) or own.get(param)
            if param.requires_grad and state:
                for key, value in state_tensors(param, state).items():
                    tensors[f"{name}.{key}"] = value.detach().clone().contiguous()
        return tensors

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore a checkpoint's state for the parameters this rank holds, whatever the keys; before the first
        build, at it. The other parameters' state reaches their holders with the blocks."""
        self._restored = {}
        for full_name, tensor in tensors.items():
            name, _, key = full_name.rpartition(".")  # state keys have no dots, parameter names do
            self._restored.setdefault(name, {})[key] = tensor
        if self._built:
            self._install_restored()

    def _install_restored(self) -> None:
        if self.optimizer is not None and self._restored:
            names = {param: name for name, param in self.model.named_parameters()}
            for param in self.params:
                if names[param] in self._restored:
                    self.optimizer.state[param] = place_state(param, self._restored[names[param]])
        self._restored = {}
