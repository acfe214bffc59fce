"""Fault injection: kill a worker at a named point of the protocol, to test what the others do.

A worker that dies at a random moment almost never dies inside a layout handover (milliseconds per
transition), yet that is where a lost peer is hardest on the rest: they wait in point-to-point
receives. ``PIPETRANSFORMER_FAULT=<point>:<rank>`` makes that rank SIGKILL itself when it reaches
``<point>`` in the job's first attempt (torchrun's restart count 0), so a restart can show recovery.
Unset (always, outside tests) it costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["FAULT_ENV", "FAULT_POINTS", "maybe_fail"]

FAULT_ENV = "PIPETRANSFORMER_FAULT"
FAULT_POINTS = ("handover",)
"""``handover``: at a layout transition, before sending or receiving blocks; its peers wait in the p2p."""


def maybe_fail(point: str, rank: int) -> None:
    """SIGKILL this process if ``PIPETRANSFORMER_FAULT`` names ``point`` and ``rank`` (first attempt only)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    name, _, target = spec.partition(":")
    if name not in FAULT_POINTS or not target.isdigit():
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected <point>:<rank> with point one of {', '.join(FAULT_POINTS)}")
    if name == point and int(target) == rank:
        os.kill(os.getpid(), signal.SIGKILL)
