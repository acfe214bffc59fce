"""AutoFreeze for a plain PyTorch loop: observe each step's per-layer gradients, decide with the package's freeze
policy, and freeze the converged leading layers of the user's own model, optimizer and DDP wrapper.

The same code path as the trainer's ``train/autofreeze.py``: per-layer ``|g|^2`` and the policy's signal (the descent
``-g_t . (w_t - w_{t-1})``, or ``g_t . g_{t-1}`` for the coherence test) from ``freeze.apply``, all-reduced in a ``train.control.ControlVector`` so every rank takes the same decision, the
policy built by ``freeze.policies.policy_from_settings`` from ``config.FreezeConfig`` (its defaults unless the
caller passes settings). A decision freezes the layers' parameters (``requires_grad`` off, out of the optimizer,
every other parameter keeping its state), pins them in eval mode, runs them without autograd, and takes them out
of DDP's all-reduce (``integrations.ddp``). Under DDP every rank holds the same gradients and weights, so each
measures a share of the layers (``freeze.apply.replica_share``) and the sum puts them together. Under FSDP2 (``fully_shard``) each rank holds a shard of every
gradient, so every rank contributes its shards' statistics to the sum, and a frozen layer leaves the reduce-scatter
by itself (its parameters get no gradient), and the backward's all-gather but for the top frozen layer (FSDP2
prefetches the weights of the layer below each backward). With ``cache=CacheConfig(enabled=True)``
the frozen layers' output is also kept per sample and served inside :meth:`AutoFreezer.serving`
(``integrations.cache``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from pipetransformer.config import CacheConfig, FreezeConfig
from pipetransformer.freeze.apply import (PreviousGradients, PreviousWeights, block_grad_sq_norms, drop_from_optimizer,
                                          pin_eval, replica_share)
from pipetransformer.freeze.policies import (UNWINDOWED, CoherencePolicy, DescentPolicy, FreezePrior, GradientPolicy,
                                             frozen_prefix_layers, policy_from_settings, resolve_prior)
from pipetransformer.integrations.cache import PrefixServer
from pipetransformer.integrations.ddp import check_droppable, drop_frozen_from_ddp
from pipetransformer.integrations.layers import LayerStack, find_layer_stack
from pipetransformer.train.control import ControlLedger, ControlVector

__all__ = ["AutoFreezer", "sharded_by_fsdp2"]

logger = logging.getLogger(__name__)

STATE_VERSION = 1
MAX_UNREAD_STEPS = 64
"""The host reads the steps' statistics from the device at a decision window's end, or once this many are pending (a
policy without windows reads none): a read waits for the GPU, and the vectors held are a few bytes a layer."""
FRACTION = "fraction"
EPOCHS = "epochs"


class _NoGrad:
    """Forward hooks that run a frozen module without autograd and restore the caller's grad mode after it."""

    def __init__(self) -> None:
        self._modes: list[bool] = []

    def before(self, module: nn.Module, args: Any) -> None:
        self._modes.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        torch.set_grad_enabled(self._modes.pop())


def _checkpoints_reentrantly(layer: nn.Module) -> bool:
    """Whether a Hugging Face layer runs under ``torch.utils.checkpoint``'s reentrant variant (``use_reentrant`` True,
    or unset, which torch reads as True): checked at each forward, since the Trainer turns checkpointing on in
    ``train()``, after the callback was attached."""
    if not getattr(layer, "gradient_checkpointing", False):
        return False
    function = getattr(layer, "_gradient_checkpointing_func", None)
    return getattr(function, "keywords", {}).get("use_reentrant") is not False


def sharded_by_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard`` on it or on any of its modules); FSDP1's wrapper is
    refused: it flattens a module's parameters into one, whose ``requires_grad`` cannot change for a layer alone."""
    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        raise ValueError("AutoFreezer cannot freeze layers inside FullyShardedDataParallel (FSDP1), which flattens "
                         "their parameters: shard the model with torch.distributed.fsdp.fully_shard (FSDP2) instead")
    return any(isinstance(module, FSDPModule) for module in model.modules())


def _optimizer_steps_now(optimizer: Any) -> bool:
    """False on an accumulation micro-step of Accelerate's ``AcceleratedOptimizer`` (its ``step`` does nothing
    there); True for any other optimizer."""
    return getattr(getattr(optimizer, "gradient_state", None), "sync_gradients", True)


class _ParameterGroup:
    """Parameters judged as one unit (a block of ``freeze.apply``'s statistics)."""

    def __init__(self, parameters: Sequence[nn.Parameter]) -> None:
        self._parameters = list(parameters)

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self._parameters)


class _DescentUnits:
    """What the descent test judges, one unit per layer: layer 0 with the embedding parameters that freeze with it
    (a tied table, which keeps training, is not one of them), then each other layer."""

    def __init__(self, stack: LayerStack) -> None:
        self.stack = stack

    @property
    def blocks(self) -> Sequence[Any]:
        return [_ParameterGroup(self.stack.prefix(1, embeddings=True)[0]), *self.stack.layers[1:]]

    def __len__(self) -> int:
        return len(self.stack)


class AutoFreezer:
    """Freezes the converged leading layers of ``model`` while a plain loop trains it.

    ``model``: a Hugging Face encoder or decoder (with or without a head, possibly inside
    ``DistributedDataParallel`` or sharded by FSDP2's ``fully_shard``), whose layers are found by structure, or a
    :class:`LayerStack` naming the ordered layers (and the embeddings that freeze with layer 0) of any model, with
    ``ddp`` its wrapper if any.
    Call :meth:`step` on every rank after ``loss.backward()`` and before ``optimizer.step()``: it reads the step's
    gradients (DDP has already averaged them) and, when the policy freezes layers, takes them out of ``optimizer``
    before it steps. The statistics stay on the device until a decision window ends (a read waits for a GPU). What
    froze before the first step (the prior) is recorded in ``at_start``.
    ``total_steps`` (the planned optimizer steps) sizes the default decision windows (a share of the run), and
    ``learning_rates`` (one per step, any scale; constant when omitted) the learning-rate budget that bounds how deep
    the coherence and gradient tests may freeze by each step (the default descent test has no budget). ``settings``
    are ``FreezeConfig`` fields (its defaults otherwise; ``enabled`` is ignored). A ``prior`` of ``auto`` freezes the
    embeddings and a third of the layers from the first step for pretrained weights (the default prior freezes
    nothing): ``pretrained`` says whether they are (default: a Hugging Face model loaded with ``from_pretrained``,
    which records its path).
    ``cache`` (``CacheConfig`` with ``enabled``) keeps the frozen layers' output per sample for the forwards run
    inside :meth:`serving`; it needs ``cache_samples`` (the dataset's size) and, for text, ``cache_max_length``
    (the longest batch, in tokens).
    """

    def __init__(self, model: nn.Module | LayerStack, optimizer: torch.optim.Optimizer, *,
                 total_steps: int | None = None, settings: FreezeConfig | None = None,
                 learning_rates: Sequence[float] | None = None, pretrained: bool | None = None,
                 ddp: DistributedDataParallel | None = None, seed: int = 0, cache: CacheConfig | None = None,
                 cache_samples: int | None = None, cache_max_length: int | None = None) -> None:
        self.settings = settings or FreezeConfig()
        self.ddp = model if isinstance(model, DistributedDataParallel) else ddp
        if self.ddp is not None:
            check_droppable(self.ddp)
        self.sharded = sharded_by_fsdp2(model if not isinstance(model, LayerStack)
                                   else model.model or nn.ModuleList(model.layers))
        """FSDP2: every rank holds a shard of each gradient (under DDP every rank holds all of it, alike)."""
        if isinstance(model, LayerStack):
            self.stack = model
        else:
            self.stack = find_layer_stack(model.module if isinstance(model, DistributedDataParallel) else model)
        if self.settings.interval_unit == EPOCHS:
            raise ValueError("AutoFreezer counts optimizer steps, not epochs: use settings with interval_unit "
                             "'fraction' (the default, with total_steps=) or 'steps'")
        if self.settings.interval_unit == FRACTION and self.settings.policy not in UNWINDOWED \
                and (total_steps is None or total_steps < 1):
            raise ValueError("AutoFreezer needs total_steps (the planned optimizer steps) to size its decision "
                             "windows as a share of the run; pass total_steps=, or settings with interval_unit='steps'")
        self.optimizer = optimizer
        if pretrained is None:
            pretrained = bool(getattr(getattr(self.stack.model, "config", None), "name_or_path", ""))
        self.prior: FreezePrior = resolve_prior(self.settings.prior, len(self.stack), pretrained=pretrained)
        self.policy = policy_from_settings(self.settings, len(self.stack), seed=seed, total_steps=total_steps or 1,
                                           prior_layers=self.prior.layers, learning_rates=learning_rates)
        # each policy's signal, and only what it reads
        self.previous_grads = PreviousGradients() if isinstance(self.policy, CoherencePolicy) else None
        self.previous_weights = PreviousWeights() if isinstance(self.policy, DescentPolicy) else None
        self._units = _DescentUnits(self.stack)
        self._device = next(p for layer in self.stack.layers for p in layer.parameters()).device  # the model's
        self.frozen_layers = 0
        self._frozen_modules: set[int] = set()
        self.steps = 0
        self._unread = ControlLedger()  # the steps' all-reduced statistics, on the device until the policy needs them
        self._hooks: list[RemovableHandle] = []
        self._boundary_hook: RemovableHandle | None = None
        self.cache: PrefixServer | None = None
        if cache is not None and cache.enabled:
            if cache_samples is None:
                raise ValueError("AutoFreezer(cache=...) needs cache_samples, the dataset's size, to key each "
                                 "sample's record by its index")
            if self.sharded:
                raise ValueError("the activation cache runs the frozen layers' forwards itself, past FSDP2's "
                                 "all-gather of their weights: use the cache without fully_shard (DDP or one "
                                 "process), or FSDP2 without cache=")
            if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
                raise ValueError("the activation cache swaps the frozen layers' forwards for each batch, which a "
                                 "compiled model does not follow: use the cache with the model uncompiled, or "
                                 "compile it without cache=")
            self.cache = PrefixServer(self.stack, cache, num_samples=cache_samples, max_length=cache_max_length)
        self._warn_if_nothing_can_freeze(total_steps)
        self._warn_if_evidence_is_blocked()
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("autofreeze: %s; frozen layers run without autograd, %s", self.prior.describe(),
                        "and from the activation cache inside serving(indices)" if self.cache else
                        "not from the activation cache (samples that keep their index and inputs can be served: "
                        "AutoFreezer's cache= with serving(indices), or AutoFreezeCallback.attach(trainer, cache=))")
        self._freeze(frozen_prefix_layers(self.policy.frozen))  # the prior (and a schedule's entry at 0)
        self.at_start: dict[str, Any] | None = None
        """The record of what froze before the first step (``step`` 0, ``frozen_layers``, ``at_start``: the
        prior's description), None when nothing did: :meth:`step` returns only the decisions taken by evidence."""
        if self.frozen_layers or self.prior.embeddings:
            self.at_start = {"step": 0, "frozen_layers": self.frozen_layers, "at_start": self.prior.describe()}

    def _warn_if_nothing_can_freeze(self, total_steps: int | None) -> None:
        if self.policy.name in UNWINDOWED or total_steps is None or (dist.is_initialized() and dist.get_rank()):
            return
        needed = self.policy.interval * self.policy.windows_before_a_freeze(self.policy.interval)
        if needed > total_steps:
            logger.warning("autofreeze: the first decision needs %d steps but the run has %d, so nothing will "
                           "freeze; shorten the windows (settings interval, min_window_steps, learned_min_steps)",
                           needed, total_steps)

    def _warn_if_evidence_is_blocked(self) -> None:
        """A layer without trainable parameters (LoRA's ``layers_to_transform`` leaves some without adapters) gives
        the gradient tests nothing to judge, so they never freeze it nor anything above it: say so before training."""
        if not isinstance(self.policy, (CoherencePolicy, DescentPolicy, GradientPolicy)) or (dist.is_initialized() and
                                                                            dist.get_rank()):
            return
        start = frozen_prefix_layers(self.policy.frozen)
        blocked = next((i for i in range(start, len(self.stack))
                        if not any(p.requires_grad for p in self.stack.layers[i].parameters())), None)
        if blocked is not None:
            logger.warning("autofreeze: layer %d has no trainable parameters, so the %s test cannot find it converged "
                           "and will freeze nothing from it up; to freeze the layers below the first trainable one "
                           "from the start, pass settings with prior=<that layer's index>", blocked, self.policy.name)

    def step(self) -> dict[str, Any] | None:
        """Observe this step's gradients (every rank must call) and freeze what the policy decides; returns the
        decision's record (``step``, ``frozen_layers`` and the policy's numbers) when layers froze, else None.
        Under Accelerate's gradient accumulation it observes only the steps its optimizer takes: on a micro-step
        (``accelerator.sync_gradients`` False) the gradients are partial and not yet all-reduced, so it returns
        None as the optimizer skips its step."""
        if not _optimizer_steps_now(self.optimizer):
            return None
        control = ControlVector.zeros(len(self.stack), self._device)
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        # FSDP2's ranks measure every layer, a shard each, and rank 0 says which are valid (every rank's shards had a
        # previous step at the same steps). After DDP's all-reduce every rank holds the same: each measures a share.
        layers = range(len(self.stack)) if self.sharded else replica_share(range(len(self.stack)), world, rank)
        says_valid = rank == 0 or not self.sharded
        control.layer_grad_sq.copy_(block_grad_sq_norms(self.stack, layers))
        if self.previous_grads is not None:
            dots, valid = self.previous_grads.block_dots(self.stack, layers)
            control.layer_grad_dots.copy_(dots)
            if says_valid:
                control.layer_dot_valid.copy_(valid)
        if self.previous_weights is not None:
            descents, valid = self.previous_weights.block_descents(self._units, layers)
            control.layer_descents.copy_(descents)
            if says_valid:
                control.layer_descent_valid.copy_(valid)
        self._unread.append(self.steps, control.all_reduce(device=self._device))
        if self.policy.next_step_ends_a_window() or len(self._unread) >= MAX_UNREAD_STEPS:
            self._observe_unread()
        decision = self.policy.decide(self.steps, 0, epoch_end=False)
        self.steps += 1
        if decision is None:
            return None
        frozen = frozen_prefix_layers(decision.frozen)
        self._freeze(frozen)
        return {"step": decision.step, "frozen_layers": frozen,
                **{k: v for k, v in decision.details.items() if isinstance(v, (int, float, str, list))}}

    def _observe_unread(self) -> None:
        """Hand the policy every pending step's statistics, in order (one copy from the device for them all)."""
        for _, control in self._unread.read():
            self.policy.observe(control.layer_grad_norms(),
                                control.layer_dots() if self.previous_grads is not None else None,
                                control.descents() if self.previous_weights is not None else None)

    def _freeze(self, frozen_layers: int) -> None:
        """Freeze the first ``frozen_layers`` layers and the embeddings (with layer 0 or by the prior) in the model,
        the optimizer and DDP."""
        parameters, modules = self.stack.prefix(frozen_layers, embeddings=self.prior.embeddings)
        if not {id(m) for m in modules} - self._frozen_modules:
            return
        for parameter in parameters:
            parameter.requires_grad_(False)
            parameter.grad = None
        for module in modules:
            if id(module) not in self._frozen_modules:
                self._frozen_modules.add(id(module))
                pin_eval(module)
                hooks = _NoGrad()
                self._hooks.append(module.register_forward_pre_hook(hooks.before))
                self._hooks.append(module.register_forward_hook(hooks.after, always_call=True))
        if self._boundary_hook is not None:
            self._boundary_hook.remove()
        # registered after the boundary's no-grad hooks, so it runs once grad mode is back on
        self._boundary_hook = modules[-1].register_forward_hook(self._graph_for_a_reentrant_checkpoint)
        drop_from_optimizer(self.optimizer, set(map(id, parameters)))
        if self.ddp is not None:
            drop_frozen_from_ddp(self.ddp)
        self.frozen_layers = frozen_layers
        logger.info("autofreeze: step %d, the embeddings and the first %d of %d layers frozen", self.steps,
                    frozen_layers, len(self.stack))

    def _graph_for_a_reentrant_checkpoint(self, module: nn.Module, args: Any, output: Any) -> None:
        """A reentrant checkpoint records a graph only when one of its inputs requires grad, and the frozen prefix's
        output, computed without autograd, does not: the first training layer and every one above it would get no
        gradient. So where that layer checkpoints reentrantly, the prefix's output is marked as requiring grad (as
        ``enable_input_require_grads`` marks the embeddings' output for transformers' own frozen embeddings); the
        non-reentrant checkpoint, transformers' default, needs nothing and costs nothing here."""
        if self.frozen_layers >= len(self.stack) or not torch.is_grad_enabled() \
                or not _checkpoints_reentrantly(self.stack.layers[self.frozen_layers]):
            return
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(hidden, torch.Tensor) and hidden.is_floating_point() and not hidden.requires_grad:
            hidden.requires_grad_(True)

    @contextmanager
    def serving(self, indices: torch.Tensor | Sequence[int]) -> Iterator[None]:
        """Run the model's forward on the dataset samples ``indices`` inside this: the frozen layers' output is
        served from the cache where every sample has it, and recorded otherwise (without a cache: no effect)."""
        if self.cache is None:
            yield
            return
        with self.cache.serving(indices, self.frozen_layers):
            yield

    def close(self) -> None:
        """Release the cache's store (its files are already unlinked, so an exit without this leaves nothing)."""
        if self.cache is not None:
            self.cache.close()

    def outcome(self) -> str:
        """One line: how many layers froze, or why none did."""
        self._observe_unread()
        return self.policy.outcome()

    def state_dict(self) -> dict[str, Any]:
        """The policy's counters and frozen set: put it in your checkpoint beside the model and optimizer."""
        self._observe_unread()
        return {"version": STATE_VERSION, "steps": self.steps, "policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a checkpointed run: re-freeze its layers. Call it before ``optimizer.load_state_dict`` (the
        saved optimizer holds only the parameters that were still training)."""
        self.policy.load_state_dict(state["policy"])
        self.steps = int(state["steps"])
        self._unread.read()  # steps before the checkpoint's are not this run's
        self._freeze(frozen_prefix_layers(self.policy.frozen))

