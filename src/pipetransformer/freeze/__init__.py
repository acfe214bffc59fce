"""AutoFreeze: decide which leading layers stop training (``policies``, pure logic) and apply it (``apply``, on the
model). Only the decisions are re-exported here, so reading a config (which names the policies) needs no torch."""

from __future__ import annotations

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
    "FreezeDecision",
    "FreezePolicy",
    "frozen_blocks",
    "frozen_prefix_layers",
    "geometric_frozen_count",
    "make_policy",
    "policy_from_settings",
]
