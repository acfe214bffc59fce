"""AutoCache for a plain loop: serve the frozen layers' output per sample from the package's activation store.

A user's model runs its own forward, so the prefix is served by hooks on its layers, within
``AutoFreezer.serving(indices)``. With ``k`` leading layers frozen, a batch whose every sample has a record
of the same depth ``s <= k`` skips the frozen layers: layer 0 returns the records (cut to the batch's
sequence length), layers ``1 .. s-1`` pass their input on, and layers ``s .. k-1`` run (a record left by a
shallower freeze is advanced). Any other batch runs as it is. Either way layer ``k-1``'s output is written
as the samples' records at depth ``k``. A batch whose samples have records of mixed depths, or none,
simply runs in full and refreshes them. This holds while:

- each sample's index is stable and its inputs are the same every epoch (no random augmentation);
- text is padded on the right. Records are stored to ``max_length`` positions and cut to the batch's
  length, so a sample's tokens keep their positions;
- every layer of the stack gets the same arguments besides the hidden states, as in the layer loops of
  Hugging Face encoders and decoders;
- nothing random runs before the boundary. A dropout in training mode in the trunk outside the layers,
  such as GPT-2's embedding dropout, makes the prefix random, and then the cache stays off.

Under ``torchrun`` each node's ranks share one store, as in the trainer (``train/autocache.py``), so a
sample that a rank computed is served to whichever rank draws it next epoch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.cache.node import open_node_store
from pipetransformer.cache.store import EMPTY_BOUNDARY, ActivationStore, spec_from_activation
from pipetransformer.config import CacheConfig
from pipetransformer.distributed import DistEnv
from pipetransformer.integrations.layers import LayerStack, model_trunk

__all__ = ["PrefixServer", "dropouts_before_layers"]

logger = logging.getLogger(__name__)

HIDDEN_STATES = "hidden_states"
"""The keyword a Hugging Face layer takes its input by, when it is not passed first."""
SEQUENCE_DIM = 1


def dropouts_before_layers(stack: LayerStack) -> list[tuple[str, nn.Module]]:
    """The dropouts in the model's trunk outside its layers and embeddings: in training mode with ``p > 0`` they
    make the input of the first layer random, so its output cannot be stored."""
    if stack.model is None:
        return []
    trunk = model_trunk(stack.model)
    inside = {id(m) for part in (*stack.layers, *stack.embeddings) for m in part.modules()}
    return [(f"{type(trunk).__name__}.{name}", module) for name, module in trunk.named_modules()
            if id(module) not in inside and isinstance(module, nn.modules.dropout._DropoutNd)]


def _hidden_states(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] if args else kwargs[HIDDEN_STATES]


def _first_rows(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each distinct sample of ``indices`` once, and the row it first stands in."""
    samples, inverse = torch.unique(indices, return_inverse=True)
    rows = torch.full((samples.numel(),), indices.numel(), dtype=torch.long)
    rows.scatter_reduce_(0, inverse, torch.arange(indices.numel()), reduce="amin")
    return samples, rows


def _local_env(device: torch.device) -> DistEnv:
    """This process's place under ``torchrun`` (or alone), for the store's per-node sharing; ``device``: the
    model's, where the user's process group can send tensors (a CUDA device under NCCL)."""
    if not dist.is_initialized():
        return DistEnv(0, 1, 0, 1, device, "")
    world = dist.get_world_size()
    return DistEnv(dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", dist.get_rank())),
                   int(os.environ.get("LOCAL_WORLD_SIZE", world)), device, dist.get_backend())


@dataclass(eq=False)
class PrefixServer:
    """Serves the output of a :class:`LayerStack`'s frozen leading layers from an :class:`ActivationStore`.

    ``num_samples``: the dataset's size (indices run from 0 to ``num_samples - 1``); ``max_length``: the longest
    sequence a text batch may have (a record's length), None for inputs of fixed shape. ``hits``, ``advanced`` and
    ``computed`` count samples served, advanced from a shallower record, and run in full.
    """

    stack: LayerStack
    settings: CacheConfig
    _: KW_ONLY
    num_samples: int
    max_length: int | None
    store: ActivationStore | None = field(default=None, init=False)
    off_reason: str = field(default="", init=False)
    hits: int = field(default=0, init=False)
    advanced: int = field(default=0, init=False)
    computed: int = field(default=0, init=False)
    _warned_length: bool = field(default=False, init=False)
    _dropouts: list[tuple[str, nn.Module]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"cache_samples={self.num_samples}: give the dataset's size (at least 1)")
        self._dropouts = dropouts_before_layers(self.stack)  # found once; whether they drop is read per batch

    def usable(self, frozen_layers: int) -> bool:
        """Whether batches are served at this depth; says once, on rank 0, why the cache is off."""
        if not self.off_reason:
            random = [name for name, module in self._dropouts if module.training and module.p > 0]
            if random:
                self._turn_off(f"{', '.join(random)} is a dropout in training mode before the layers, so their "
                               "output differs every time; set its p to 0 to cache")
        return not self.off_reason and frozen_layers >= max(1, self.settings.min_frozen)

    def _turn_off(self, reason: str) -> None:
        self.off_reason = reason
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("autofreeze: activation cache off: %s", reason)

    @contextmanager
    def serving(self, indices: torch.Tensor | Sequence[int], frozen_layers: int) -> Iterator[None]:
        """Within it, the model's forward on the samples ``indices`` serves and records the frozen prefix."""
        if not self.usable(frozen_layers):
            yield
            return
        idx = torch.as_tensor(indices).reshape(-1).to(device="cpu", dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_samples):
            raise ValueError(f"serving(indices): indices must lie in [0, {self.num_samples}) (cache_samples), "
                             f"got {int(idx.min())}..{int(idx.max())}")
        start = self._served_depth(idx, frozen_layers)
        saved = {id(layer): layer.__dict__.get("forward") for layer in self.stack.layers[:start]}
        hook = self.stack.layers[frozen_layers - 1].register_forward_hook(self._recorder(idx, frozen_layers, start))
        try:
            if start:
                self._skip_layers(idx, start)
            yield
        finally:
            hook.remove()
            for layer in self.stack.layers[:start]:
                if saved[id(layer)] is None:
                    layer.__dict__.pop("forward", None)  # back to the class's forward
                else:
                    layer.forward = saved[id(layer)]  # an instance forward set before (accelerate's hooks)

    def _served_depth(self, idx: torch.Tensor, frozen_layers: int) -> int:
        """The depth every sample of the batch has a record at (at most ``frozen_layers``), or 0."""
        if self.store is None or not idx.numel():
            return 0
        depths = torch.unique(self.store.lookup(idx))
        if depths.numel() != 1 or int(depths[0]) == EMPTY_BOUNDARY or int(depths[0]) > frozen_layers:
            return 0
        return int(depths[0])

    def _skip_layers(self, idx: torch.Tensor, depth: int) -> None:
        """Layer 0 returns the records of depth ``depth``; layers ``1 .. depth-1`` return their input."""
        originals: list[Callable[..., Any]] = [layer.forward for layer in self.stack.layers[:depth]]
        assert self.store is not None
        store = self.store

        def records(*args: Any, **kwargs: Any) -> torch.Tensor:
            hidden = _hidden_states(args, kwargs)
            read = store.read(idx, trim_to=hidden.shape[SEQUENCE_DIM] if self.max_length is not None else None)
            if not bool(read.served.all()):  # a corrupt disk record: this batch runs the frozen layers
                rest = {k: v for k, v in kwargs.items() if k != HIDDEN_STATES}
                for forward in originals:
                    hidden = forward(hidden, *args[1:], **rest)
                return hidden
            return read.activation[0].to(device=hidden.device, dtype=hidden.dtype)

        def passthrough(*args: Any, **kwargs: Any) -> torch.Tensor:
            return _hidden_states(args, kwargs)

        self.stack.layers[0].forward = records
        for layer in self.stack.layers[1:depth]:
            layer.forward = passthrough

    def _recorder(self, idx: torch.Tensor, depth: int, served_from: int) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if served_from == depth:
                self.hits += idx.numel()
                return  # every record is already at this depth
            hidden = output[0] if isinstance(output, tuple) else output
            if self.store is None:
                self._open(hidden)  # before any rank-local check: every rank opens at the same step
            assert self.store is not None
            recorded = self.store.layout.spec.shapes[0]
            if self.max_length is None and tuple(hidden.shape[1:]) != tuple(recorded):
                raise ValueError(f"a batch's frozen output is {tuple(hidden.shape[1:])} per sample but the cache's "
                                 f"records are {tuple(recorded)}: for text batches of varying length pass "
                                 "cache_max_length (the longest batch, in tokens)")
            if self.max_length is not None and hidden.shape[SEQUENCE_DIM] > self.max_length:
                if not self._warned_length:
                    self._warned_length = True
                    logger.warning("autofreeze: a batch of %d positions is longer than cache_max_length %d, so it "
                                   "is not cached; raise cache_max_length", hidden.shape[SEQUENCE_DIM], self.max_length)
                return
            samples, rows = _first_rows(idx)  # a batch drawn with replacement holds a sample more than once
            self.store.write(samples, (hidden.detach().index_select(0, rows.to(hidden.device)),), depth)
            if served_from:
                self.advanced += idx.numel()
            else:
                self.computed += idx.numel()
        return record

    def _open(self, example: torch.Tensor) -> None:
        """Create the node's store from the first recorded batch (every rank records its first at the same step)."""
        env = _local_env(example.device)
        spec = spec_from_activation((example,), pad_to=self.max_length)
        self.store = open_node_store(env, self.num_samples, spec, self.settings, device=env.device)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
