"""Take frozen parameters out of a live DistributedDataParallel's all-reduce.

DDP registers the parameters that require gradients when it is built; a parameter frozen later gets no
gradient, so its bucket never completes ("Expected to have finished reduction in the prior iteration"), and
``find_unused_parameters`` or a zero learning rate still all-reduce it every step. The fix is the one DDP
applies to itself when it is unpickled (``DistributedDataParallel.__setstate__``): build a new reducer over the
parameters that require gradients now. The DDP object stays the same, so whoever holds it (a user's loop, the
Hugging Face Trainer, Accelerate) keeps using it; the old reducer, dropped, removes its autograd hooks. Every rank
must rebuild at the same step, between an optimizer step and the next forward (the freeze decisions are
all-reduced, so they do).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["check_droppable", "drop_frozen_from_ddp"]

BUILTIN_HOOK_PREFIX = f"{dist.BuiltinCommHookType.__name__}."
"""How DDP's logger names a builtin comm hook (``BuiltinCommHookType.FP16_COMPRESS``); a Python hook goes by its
function's name."""


def _builtin_comm_hook(ddp: DistributedDataParallel) -> dist.BuiltinCommHookType | None:
    """The builtin hook registered with ``_register_builtin_comm_hook``: the reducer keeps it in C++ and only the
    logger's record names it."""
    name = ddp._get_ddp_logging_data().get("comm_hook") or ""
    if not name.startswith(BUILTIN_HOOK_PREFIX):
        return None
    return dist.BuiltinCommHookType.__members__[name.removeprefix(BUILTIN_HOOK_PREFIX)]


def check_droppable(ddp: DistributedDataParallel) -> None:
    """Refuse, before training, a wrapper whose reducer cannot be rebuilt this way."""
    if ddp.mixed_precision is not None or getattr(ddp, "_use_python_reducer", False):
        raise ValueError("cannot drop frozen parameters from a DistributedDataParallel with mixed_precision or the "
                         "Python reducer; wrap the model in a plain DistributedDataParallel")


def drop_frozen_from_ddp(ddp: DistributedDataParallel) -> None:
    """Rebuild ``ddp``'s reducer over the parameters that require gradients now; its comm hook (registered with
    ``register_comm_hook``, or a builtin one) is registered again on it."""
    check_droppable(ddp)
    hooks = list(ddp._comm_hooks)
    builtin = _builtin_comm_hook(ddp)
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    param_to_name_mapping = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, param_to_name_mapping, ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    ddp._comm_hooks = []
    for hook, state in hooks:
        ddp.register_comm_hook(state, hook)
    if builtin is not None:
        ddp._register_builtin_comm_hook(builtin)

