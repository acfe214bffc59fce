"""AutoFreeze: decide which leading layers stop training (``policies``) and apply it (``apply``)."""

from __future__ import annotations

from pipetransformer.freeze.apply import (
    PreviousGradients,
    block_grad_sq_norms,
    freeze_blocks,
)
from pipetransformer.freeze.policies import (
    FreezeDecision,
    FreezePolicy,
    frozen_blocks,
    frozen_prefix_layers,
    geometric_frozen_count,
    make_policy,
    policy_from_settings,
)

__all__ = [
    "PreviousGradients",
    "block_grad_sq_norms",
    "FreezeDecision",
    "FreezePolicy",
    "freeze_blocks",
    "frozen_blocks",
    "frozen_prefix_layers",
    "geometric_frozen_count",
    "make_policy",
    "policy_from_settings",
]
