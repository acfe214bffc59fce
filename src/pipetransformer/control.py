"""The per-step control vector: what every rank must agree on after a step, in one all-reduce.

Per-layer gradient statistics (for the freeze policy), the total gradient norm (for clipping), stop requests
(SIGTERM on any rank) and the loss travel together as one float64 tensor summed over the world, so every rank,
idle ones included, takes the same freeze, clip and stop decisions. Each field is contributed by exactly one
kind of rank (gradients by replica 0 of each stage, the loss by the last stages), so the sum assembles them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

__all__ = ["ControlVector"]


@dataclass
class ControlVector:
    layer_grad_sq: torch.Tensor  # [L] squared gradient norm of each transformer layer
    layer_grad_dots: torch.Tensor  # [L] g_t . g_{t-1} of each layer (0 where not valid)
    layer_dot_valid: torch.Tensor  # [L] 1 where the layer's dot product is valid
    total_grad_sq: torch.Tensor  # [1] squared norm of every trainable gradient (embeddings and head included)
    stop_requests: torch.Tensor  # [1] ranks that received SIGTERM
    loss: torch.Tensor  # [1] the step's loss summed over the last stages (already a mean over the global batch)

    @classmethod
    def zeros(cls, num_layers: int) -> ControlVector:
        shapes = {"layer_grad_sq": num_layers, "layer_grad_dots": num_layers, "layer_dot_valid": num_layers}
        return cls(**{f.name: torch.zeros(shapes.get(f.name, 1), dtype=torch.float64) for f in fields(cls)})

    def all_reduce(self) -> ControlVector:
        """Sum every field over the default group (one collective); returns the summed vector."""
        parts = [getattr(self, f.name) for f in fields(self)]
        packed = torch.cat(parts)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed)
        return ControlVector(*torch.split(packed, [p.numel() for p in parts]))

    def layer_grad_norms(self) -> list[float]:
        return [float(v) ** 0.5 for v in self.layer_grad_sq]

    def layer_dots(self) -> list[float | None]:
        """Per layer, the dot product where it is valid, else None."""
        return [float(d) if v > 0 else None for d, v in zip(self.layer_grad_dots, self.layer_dot_valid)]
