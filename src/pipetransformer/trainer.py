"""The training loop that composes the four automations; none of their internals live here.

One step: sampler -> this replica's share -> frozen prefix (cache or no-grad forward) -> stages (a local
forward/backward, or a pipeline schedule) -> gradient sync of trainable blocks over the stage's replicas
-> one world all-reduce of the control vector (per-layer gradient norms, loss) -> clip -> optimizer.
At a freeze decision: policy -> apply -> plan (partition, compression) -> handover -> new groups.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .cache.prefix import FrozenPrefixCache
from .cache.store import ActivationStore, StoreLayout, spec_from_activation
from .checkpoint import (META_CONFIG_KEY, META_FINGERPRINT_KEY, Checkpoint, CheckpointError, check_compatible,
                         latest_valid_checkpoint, load_checkpoint, model_fingerprint, save_checkpoint, write_tensors)
from .config import Config, ConfigError, config_to_dict
from .control import ControlVector
from .data import datasets_from_config, small_split_warnings
from .data.batch import Batch, IndexedDataset
from .data.sampler import ElasticSampler
from .distributed import (DistEnv, broadcast_string, broadcast_tensors, init_distributed, new_groups,
                          raise_together, shutdown_distributed)
from .dp.handover import BlockTransfer, broadcast_blocks, place_state, state_tensors, transfer_blocks
from .dp.sync import GradientSync
from .faults import maybe_fail
from .freeze import (PreviousGradients, block_grad_sq_norms, freeze_blocks, frozen_blocks, frozen_prefix_layers,
                     policy_from_settings)
from .freeze.policies import UNWINDOWED, FreezeDecision
from .metrics import JsonlWriter, MetricsLog, StepTimer, truncate_log, write_json
from .models import BlockSequence, build_model, load_tokenizer, minilm_path
from .optim import build_optimizer, layer_lr_scales, lr_at, set_lr
from .pipe.cost import BlockCost
from .pipe.layout import transfer_plan
from .pipe.planner import LayoutPlan, plan_layout, step_micro_batches
from .pipe.profile import estimate_block_costs
from .pipe.stage import PipelineRunner, StageModule

__all__ = ["Trainer", "TrainingDivergedError", "train"]

logger = logging.getLogger(__name__)

LENGTH_BUCKET = 8
"""Pipelined text batches are padded up to a multiple of this, so stages see few distinct shapes."""
PROFILE_BATCH = 8
WINDOWS_BEFORE_A_FREEZE = {"gradient": 2, "coherence": 3}
"""The gradient test compares two windows; coherence needs a window of learning, then two below its threshold."""
BEST_VALIDATION_DIR = "best-validation"
"""Under the checkpoint directory: the weights of the best validation accuracy, tested once at the end."""
CLIP_EPSILON = 1e-6  # as torch.nn.utils.clip_grad_norm_
RNG_MODULUS = 2**63  # torch.manual_seed takes a 64-bit seed
SAMPLE_LOG_PREFIX = "samples-rank"  # + rank + .jsonl (run.record_samples)


class TrainingDivergedError(RuntimeError):
    """Loss or gradients became NaN/inf; the message names the step and layer."""


@dataclass
class _Held:
    """What this rank runs under the current layout."""

    plan: LayoutPlan
    replica: int | None  # None: idle rank (not in the layout)
    stage: int | None
    blocks: tuple[int, int] = (0, 0)  # [start, end) of held blocks (stage 0 includes the frozen prefix)


@dataclass
class _Progress:
    step: int = 0
    epoch: int = 0
    samples: int = 0
    layout_history: list[dict[str, Any]] = field(default_factory=list)
    eval_history: list[dict[str, Any]] = field(default_factory=list)
    transitions: list[dict[str, Any]] = field(default_factory=list)
    freeze_decisions: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    elapsed_before_s: float = 0.0  # wall time of earlier attempts (before a resume)
    epoch_done: bool = False  # the checkpointed epoch had finished (resume starts the next one)
    restarts: int = 0


class Trainer:
    """Runs one training job on this process (one of the torchrun workers, or alone)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.env: DistEnv = init_distributed(config.dist)
        self._seed_everything(config.seed)
        self.run_dir = self._resolve_run_dir()
        # Random-weight HF models (hf_config) borrow MiniLM's tokenizer: their vocab_size must cover it.
        self.tokenizer = None if config.model.kind == "vit" else load_tokenizer(config.model.path or minilm_path())
        # The validation split (eval_set) serves evaluations during training; the test split is evaluated once, at
        # the end, and nothing during training (steps, freeze decisions, evaluations) ever reads it.
        try:
            splits = datasets_from_config(config.data, self.tokenizer)
        except ValueError as error:  # the loaders' messages name the setting
            raise ConfigError(f"data: {error}") from None
        self.train_set, self.eval_set, self.test_set = splits
        for warning in small_split_warnings(splits) if self.env.is_main else []:
            logger.warning(warning)
        try:
            self.model: BlockSequence = build_model(
                config.model.kind, num_labels=self.train_set.num_classes, path=config.model.path,
                hf_config=config.model.hf_config, pooling=config.model.pooling,
                vit=dict(config.model.vit) if config.model.kind == "vit" else None,
                attn_implementation=config.model.attn_implementation).to(self.env.device)
        except (ValueError, TypeError) as error:  # the adapters' messages name the setting
            raise ConfigError(f"model: {error}") from None
        self.model.train()
        self.num_blocks = len(self.model)
        self.sampler = ElasticSampler(len(self.train_set), seed=config.seed, drop_last=config.train.drop_last)
        # Planned optimizer steps at the starting global batch: what freeze.interval_unit fraction is a share of.
        self.planned_steps = math.ceil(self._total_samples() / config.train.batch_size)
        f = config.freeze
        try:
            self.policy = policy_from_settings(f, self.model.num_layers, seed=config.seed,
                                               total_steps=self.planned_steps, enabled=f.enabled)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self._warn_if_freeze_cannot_fire()
        # g_t . g_{t-1} per layer: the coherence policy's signal, and logged for replay when every step is logged.
        self.previous_grads = (PreviousGradients() if self.policy.name == "coherence" or config.run.log_every == 1
                               else None)
        self.progress = _Progress()
        self.initial_width: int | None = None
        self.checkpoint_dir = Path(config.checkpoint.dir or self.run_dir / "checkpoints")
        resumed = self._resume_checkpoint()
        if resumed is not None:
            self._restore(resumed)
        self.costs = self._block_costs()
        self.cache: FrozenPrefixCache | None = None
        self.eval_cache: FrozenPrefixCache | None = None
        self.store: ActivationStore | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.held = self._adopt(self._plan(), previous=None)
        if self.initial_width is None:  # a resumed run keeps the width it started with
            self.initial_width = self.held.plan.layout.dp_width
        if resumed is not None:
            self._restore_optimizer(resumed.optimizer)
        append = resumed is not None
        if append:
            self._truncate_sample_logs()
        self.metrics = (MetricsLog(self.run_dir, append=append, tensorboard=config.run.tensorboard,
                                   next_step=self.progress.step + 1) if self.env.is_main else None)
        self.sample_log = (JsonlWriter(self.run_dir / f"{SAMPLE_LOG_PREFIX}{self.env.rank}.jsonl", append)
                           if config.run.record_samples else None)
        self._lr = 0.0  # of the current step
        self._loss_denominator = 1
        self._allreduce_bytes = 0
        self._layer_norms: list[float] = []
        self._layer_dots: list[float | None] | None = None
        self._started = time.perf_counter()
        self._sigterm_received = False  # this rank, set by the signal handler at any moment
        self._stop_requested = False  # agreed by all ranks through the control vector, so all stop at one step
        if self.env.is_main:  # only once set-up succeeded: a bad config never overwrites a run's record
            (self.run_dir / "config.yaml").write_text(_dump_yaml(config_to_dict(config)))

    # ----------------------------------------------------------------------------------- setup
    def _seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self.config.deterministic:
            torch.use_deterministic_algorithms(True)

    def _resolve_run_dir(self) -> Path:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = self.config.run.name or "run"
        path = self.config.run.dir or str(Path("runs") / f"{name}-{stamp}")
        path = broadcast_string(path)
        run_dir = Path(path)
        if self.env.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir

    def _example_inputs(self, rows: int) -> tuple[torch.Tensor, ...]:
        rows = min(rows, len(self.train_set))
        pad = self.config.data.max_length if self.train_set.task == "text" else None
        batch = self.train_set.get_batch(list(range(rows)), pad_to=pad)
        return tuple(t.to(self.env.device) for t in batch.inputs)

    def _block_costs(self) -> list[BlockCost]:
        """Measured (or estimated) on rank 0 and broadcast, so every rank plans from the same numbers."""
        if not self.config.pipe.enabled:
            return [BlockCost(1.0, 2.0, 0, 0, 0) for _ in range(self.num_blocks)]
        costs = estimate_block_costs(self.model, self._example_inputs(PROFILE_BATCH),
                                     num_classes=self.train_set.num_classes,
                                     measure=self.config.pipe.profile) if self.env.is_main else []
        table = torch.tensor([[c.forward_s, c.backward_s, c.output_bytes, c.param_bytes, c.activation_bytes]
                              for c in costs] if costs else [[0.0] * 5] * self.num_blocks, dtype=torch.float64)
        if self.env.distributed:
            dist.broadcast(table, src=0)
        return [BlockCost(float(r[0]), float(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in table.tolist()]

    def _total_samples(self) -> int:
        """The length of the learning-rate schedule and the progress bar, in samples: steps are not known in
        advance when the global batch grows with the width (keep_per_pipeline). max_steps only stops a run."""
        return len(self.train_set) * self.config.train.epochs

    def _samples_done(self) -> int:
        """Samples of the schedule before the sampler's position; a finished epoch counts whole, its dropped
        tail (drop_last) included."""
        epoch = self.progress.epoch + 1 if self.progress.epoch_done else self.sampler.epoch
        position = 0 if self.progress.epoch_done else self.sampler.position
        return epoch * len(self.train_set) + position

    def _warn_if_freeze_cannot_fire(self) -> None:
        """A decision window longer than the run freezes nothing: say so before training, once."""
        f = self.config.freeze
        if not f.enabled or f.policy in UNWINDOWED or not self.env.is_main:
            return
        steps_per_epoch = math.ceil(len(self.train_set) / self.config.train.batch_size)
        window = self.policy.interval * (steps_per_epoch if self.policy.interval_unit == "epochs" else 1)
        needed = window * WINDOWS_BEFORE_A_FREEZE.get(f.policy, 1)
        steps = min(self.planned_steps, self.config.train.max_steps or self.planned_steps)
        if needed > steps:
            logger.warning("freeze: the first decision needs %d steps but the run has %d, so nothing will freeze; "
                           "shorten freeze.interval (or use interval_unit: fraction)", needed, steps)

    # ----------------------------------------------------------------------------------- layout
    def _frozen_prefix_blocks(self) -> int:
        layers = frozen_prefix_layers(self.policy.frozen)
        return layers + 1 if layers > 0 else 0

    def _cached_blocks(self) -> int:
        layers = frozen_prefix_layers(self.policy.frozen)
        if not self.config.cache.enabled or layers < self.config.cache.min_frozen:
            return 0
        return layers + 1

    def _plan(self) -> LayoutPlan:
        return plan_layout(self.config, self.costs, self.env.world_size, frozen_blocks=self._frozen_prefix_blocks(),
                           cached_blocks=self._cached_blocks(), dp_width=self.initial_width,
                           global_batch=self._global_batch_size)

    def _global_batch_size(self, width: int) -> int:
        """keep_global: train.batch_size always; keep_per_pipeline (the paper): each replica keeps the batch it
        started with, so the global batch grows with the width."""
        base = self.config.train.batch_size
        if self.config.dp.batch_policy == "keep_per_pipeline" and self.initial_width:
            return base * width // self.initial_width
        return base

    def _lr_scale(self) -> float:
        """Linear scaling rule when the global batch grows with the width (keep_per_pipeline)."""
        width = self.held.plan.layout.dp_width
        return self._global_batch_size(width) / self.config.train.batch_size

    def _adopt(self, plan: LayoutPlan, previous: _Held | None) -> _Held:
        """Make ``plan`` the current layout: hand over state, build groups, stage, optimizer, sync."""
        started = time.perf_counter()
        rank = self.env.rank
        layout = plan.layout
        replica, stage = layout.coords(rank) if rank < layout.world_size else (None, None)
        bounds = plan.held_bounds()
        held = _Held(plan, replica, stage, bounds[stage] if stage is not None else (0, 0))
        received: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        moved = 0
        if previous is not None and self.env.distributed:
            transfers = [BlockTransfer(t.block, t.src_rank, t.dst_rank) for t in transfer_plan(
                _Bounds(previous.plan.held_bounds()), previous.plan.layout, _Bounds(bounds), layout)]
            moved = len(transfers)
            maybe_fail("handover", rank)
            received = transfer_blocks(self.model, transfers, self.optimizer, rank)
        self._destroy_groups()
        self.pipe_group = new_groups(layout.all_pipeline_groups(), rank) if self.env.distributed else None
        self.dp_group = new_groups(layout.all_dp_groups(), rank) if self.env.distributed else None
        self._rebuild_optimizer(held, received)
        self._build_stage(held)
        self._ensure_cache(plan)
        record = {"step": self.progress.step, "frozen_layers": len(self.policy.frozen),
                  "frozen_prefix_layers": frozen_prefix_layers(self.policy.frozen), **plan.describe()}
        self.progress.layout_history.append(record)
        if previous is not None:
            self.progress.transitions.append({"step": self.progress.step, "seconds": time.perf_counter() - started,
                                              "blocks_moved": moved, **plan.describe()})
        return held

    def _destroy_groups(self) -> None:
        for name in ("pipe_group", "dp_group"):
            group = getattr(self, name, None)
            if group is not None:
                dist.destroy_process_group(group)
            setattr(self, name, None)

    def _held_params(self, held: _Held) -> list[torch.nn.Parameter]:
        start, end = held.blocks
        return [p for i in range(start, end) for p in self.model.blocks[i].parameters() if p.requires_grad]

    def _rebuild_optimizer(self, held: _Held, received: dict[torch.nn.Parameter, dict[str, torch.Tensor]]) -> None:
        params = self._held_params(held)
        old_state = self.optimizer.state if self.optimizer is not None else {}
        self.optimizer = build_optimizer(params, self.config.train, self._lr_scales(held)) if params else None
        if self.optimizer is not None:
            for p in params:
                if p in received:
                    self.optimizer.state[p] = received[p]
                elif p in old_state and old_state[p]:
                    self.optimizer.state[p] = old_state[p]
        if getattr(self, "sync", None) is not None:
            self.sync.close()
        # One backward per step only without a pipeline schedule: then buckets overlap backward.
        self.sync = GradientSync(params, self.dp_group, overlap=held.plan.layout.num_stages == 1)

    def _lr_scales(self, held: _Held) -> dict[torch.nn.Parameter, float]:
        """Each held parameter's learning-rate scale, from its block's place in the whole model (not the stage)."""
        scales = layer_lr_scales(len(self.model.blocks), self.config.train.layer_lr_decay)
        start, end = held.blocks
        return {p: scales[i] for i in range(start, end) for p in self.model.blocks[i].parameters()}

    def _build_stage(self, held: _Held) -> None:
        self.runner: PipelineRunner | None = None
        if held.stage is None or held.plan.layout.num_stages == 1:
            return
        start, end = held.plan.partition.bounds[held.stage]
        if held.stage == 0:
            start = max(start, held.plan.frozen_blocks)
        module = StageModule([self.model.blocks[i] for i in range(start, end)],
                             is_last=held.stage == held.plan.layout.num_stages - 1)
        assert self.pipe_group is not None
        self.runner = PipelineRunner(module, held.stage, held.plan.layout.num_stages, self.env.device,
                                     self.pipe_group, self._pipeline_loss)

    def _ensure_cache(self, plan: LayoutPlan) -> None:
        """Create the shared store the first time the cache is needed (all ranks, same moment)."""
        if plan.cached_blocks == 0 or self.store is not None:
            return
        example = self._example_inputs(1)
        with torch.no_grad():
            activation = self.model.forward_range(example, 0, plan.cached_blocks)
        pad = self.config.data.max_length if self.train_set.task == "text" else None
        spec = spec_from_activation(activation, pad_to=pad)
        disk_dir = self.config.cache.dir or tempfile.gettempdir()  # node-local: run_dir is shared across nodes
        memory_bytes = int(self.config.cache.memory_gb * 1e9)
        if self.env.is_local_leader:  # keys: training samples, then evaluation samples
            store = ActivationStore.create(len(self.train_set) + len(self.eval_set), spec, memory_bytes,
                                           disk_dir=disk_dir)
            layout_json = _layout_to_json(store.layout)
        else:
            store, layout_json = None, ""
        # Every node's leader created its own store; followers attach to their node's leader.
        layout_json = self._broadcast_from_local_leader(layout_json)
        if store is None:
            store = ActivationStore.attach(_layout_from_json(layout_json))
        if self.env.distributed:
            dist.barrier()
        if self.env.is_local_leader:
            store.unlink_names()
        self.store = store
        self.cache = FrozenPrefixCache(store)
        self.eval_cache = FrozenPrefixCache(store)  # its own hit counters: training's hit rate stays training's

    def _broadcast_from_local_leader(self, value: str) -> str:
        if not self.env.distributed:
            return value
        node_leader = self.env.rank - self.env.local_rank
        values = [broadcast_string(value if self.env.rank == leader else "", src=leader)
                  for leader in range(0, self.env.world_size, self.env.local_world_size)]
        return values[node_leader // self.env.local_world_size]

    # ----------------------------------------------------------------------------------- step
    def _pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, reduction="sum") / self._loss_denominator

    def _prefix(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """The activation entering the first block any stage runs: from the cache, or a no-grad forward."""
        inputs = tuple(t.to(self.env.device) for t in batch.inputs)
        plan = self.held.plan
        if plan.cached_blocks and self.cache is not None:
            return self.cache.activation_at_boundary(self.model, inputs, batch.indices, plan.cached_blocks)
        if plan.frozen_blocks:
            with torch.no_grad():
                return self.model.forward_range(inputs, 0, plan.frozen_blocks)
        return inputs

    def _local_batch(self, indices: list[int]) -> Batch | None:
        if not indices:
            return None
        pad = None
        if self.runner is not None and self.train_set.task == "text":
            longest = int(self.train_set.lengths[torch.tensor(indices)].max())
            pad = min(self.config.data.max_length, math.ceil(longest / LENGTH_BUCKET) * LENGTH_BUCKET)
        return self.train_set.get_batch(indices, pad_to=pad)

    def _check_finite(self, loss: float, total_norm: float, layer_sq: torch.Tensor) -> None:
        """Stop before a non-finite update reaches the weights; the last checkpoint stays the last good one."""
        if math.isfinite(loss) and math.isfinite(total_norm):
            return
        bad = [i for i, v in enumerate(layer_sq.tolist()) if not math.isfinite(v)]
        where = f"first in layer_{bad[0]}" if bad else "in the embeddings or head"
        raise TrainingDivergedError(
            f"non-finite loss ({loss}) or gradient norm ({total_norm}) at step {self.progress.step + 1}, {where}; "
            f"no update was applied; lower train.lr or set train.grad_clip, then resume from {self.checkpoint_dir}")

    def _train_step(self, global_batch: list[int], timer: StepTimer) -> float:
        """One optimizer step on ``global_batch``; returns the mean loss over the global batch."""
        # Dropout streams depend on (seed, step, rank) only, so a resumed run draws the same masks.
        torch.manual_seed(hash((self.config.seed, self.progress.step, self.env.rank)) % RNG_MODULUS)
        held = self.held
        layout = held.plan.layout
        self._loss_denominator = len(global_batch)
        size = len(global_batch)
        self._lr = lr_at(self._samples_done() - size, self._total_samples(), self.config.train, size)
        self._lr *= self._lr_scale()
        loss_sum = torch.zeros((), dtype=torch.float64)
        if held.stage is not None:
            assert held.replica is not None
            mine = ElasticSampler.split_for_replica(global_batch, layout.dp_width, held.replica)
            with timer.phase("data"):
                batch = self._local_batch(mine)
            if self.sample_log is not None and held.stage == 0:  # one record per replica
                self.sample_log.write({"epoch": self.progress.epoch, "step": self.progress.step + 1, "indices": mine})
            if batch is not None and self.runner is None:
                with timer.phase("forward"):
                    activation = self._prefix(batch)
                    logits = self.model.forward_range(activation, held.plan.frozen_blocks, self.num_blocks)[0]
                    loss = F.cross_entropy(logits, batch.labels.to(self.env.device), reduction="sum") / len(global_batch)
                with timer.phase("backward"):
                    loss.backward()
                loss_sum += loss.detach().double().cpu()
            elif batch is not None and self.runner is not None:
                with timer.phase("forward_backward"):
                    inputs = self._prefix(batch) if held.stage == 0 else None
                    micro, schedule = step_micro_batches(len(batch), held.plan.micro_batches, layout.num_stages,
                                                         self.config.pipe.schedule)
                    shape_key = (len(batch), *(batch.inputs[0].shape[1:2] if self.train_set.task == "text" else ()))
                    losses = self.runner.step(shape_key, micro, schedule, inputs, batch.labels.to(self.env.device))
                if losses:
                    loss_sum += sum(float(l.detach()) for l in losses)
            with timer.phase("allreduce"):
                self._allreduce_bytes = self.sync.synchronize()
        with timer.phase("control"):
            control = self._control_vector(held, loss_sum)
        total_norm = math.sqrt(float(control.total_grad_sq))
        loss = float(control.loss)
        self._check_finite(loss, total_norm, control.layer_grad_sq)
        self._stop_requested = bool(control.stop_requests > 0)
        with timer.phase("optimizer"):
            if self.optimizer is not None:
                clip = self.config.train.grad_clip
                if clip is not None and total_norm > 0:
                    coef = clip / (total_norm + CLIP_EPSILON)
                    grads = [p.grad for p in self._held_params(held) if p.grad is not None]
                    if coef < 1.0 and grads:
                        torch._foreach_mul_(grads, coef)
                set_lr(self.optimizer, self._lr)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        self._layer_norms = control.layer_grad_norms()
        self._layer_dots = control.layer_dots() if self.previous_grads is not None else None
        self.policy.observe(self._layer_norms, self._layer_dots)
        return loss

    def _control_vector(self, held: _Held, loss_sum: torch.Tensor) -> ControlVector:
        """Summed over the world, so every rank (idle ones too) decides the same. Gradients count from replica 0
        only (replicas hold equal ones after sync); the loss from every last stage."""
        layers = self.model.num_layers
        control = ControlVector.zeros(layers)
        control.stop_requests[0] = float(self._sigterm_received)
        if held.replica == 0:
            blocks = block_grad_sq_norms(self.model, range(*held.blocks))
            control.layer_grad_sq[:] = blocks[1:layers + 1]
            control.total_grad_sq[0] = blocks.sum()
            if self.previous_grads is not None:
                start, end = held.blocks  # layer blocks only: the policy reads no embeddings or head dots
                dots, valid = self.previous_grads.block_dots(self.model, range(max(start, 1), min(end, layers + 1)))
                control.layer_grad_dots[:] = dots[1:layers + 1]
                control.layer_dot_valid[:] = valid[1:layers + 1]
        if held.stage is not None and held.stage == held.plan.layout.num_stages - 1:
            control.loss[0] = loss_sum
        return control.all_reduce() if self.env.distributed else control

    # ----------------------------------------------------------------------------------- freeze
    def _apply_decision(self, decision: FreezeDecision) -> None:
        blocks = frozen_blocks(decision.frozen, self.model.num_layers)
        freeze_blocks(self.model, blocks, self.optimizer)
        record = {"step": self.progress.step, "epoch": self.progress.epoch, "frozen": sorted(decision.frozen),
                  **{k: v for k, v in decision.details.items() if _jsonable(v)}}
        self.progress.freeze_decisions.append(record)
        if self.metrics is not None:
            self.metrics.write({"event": "freeze", **record})
        self.held = self._adopt(self._plan(), previous=self.held)

    # ----------------------------------------------------------------------------------- eval
    def evaluate(self, dataset: IndexedDataset | None = None) -> float:
        """Accuracy on ``dataset`` (default: the validation split), sharded over every rank with the full current
        model. Only validation samples go through the cache: the test split is evaluated once."""
        dataset = self.eval_set if dataset is None else dataset
        plan = self.held.plan
        if self.env.distributed and (plan.layout.num_stages > 1 or plan.layout.world_size < self.env.world_size):
            owners = {b: plan.layout.rank(0, s) for s, (start, end) in enumerate(plan.held_bounds())
                      for b in range(start, end)}
            broadcast_blocks(self.model, owners, range(self.num_blocks))
        self.model.eval()
        correct = torch.zeros(2, dtype=torch.float64)
        indices = list(range(self.env.rank, len(dataset), self.env.world_size))
        size = self.config.train.eval_batch_size
        for start in range(0, len(indices), size):
            batch = dataset.get_batch(indices[start:start + size])
            logits = self.eval_logits(batch, use_cache=dataset is self.eval_set)
            correct[0] += (logits.argmax(-1).cpu() == batch.labels).sum().item()
            correct[1] += len(batch)
        self.model.train()
        if self.env.distributed:
            dist.all_reduce(correct)
        return float(correct[0] / correct[1])

    @torch.no_grad()
    def eval_logits(self, batch: Batch, use_cache: bool = True) -> torch.Tensor:
        """Logits of an evaluation batch from this rank's full model (call in eval mode).

        An evaluation sample's frozen-prefix output is as fixed as a training sample's, so with the cache on
        it comes from the same store (keys after the training samples'). Every evaluation runs the same
        shards in the same batches, so what the cache serves equals a plain forward bit for bit.
        """
        activation = tuple(t.to(self.env.device) for t in batch.inputs)
        boundary = self.held.plan.cached_blocks if use_cache and self.eval_cache is not None else 0
        if boundary and self.eval_cache is not None:
            activation = self.eval_cache.activation_at_boundary(self.model, activation,
                                                                batch.indices + len(self.train_set), boundary)
        return self.model.forward_range(activation, boundary, self.num_blocks)[0]

    def _record_eval(self, started: float) -> None:
        best_before = max((e["accuracy"] for e in self.progress.eval_history), default=None)
        accuracy = self.evaluate()
        entry = {"epoch": self.progress.epoch, "step": self.progress.step, "accuracy": accuracy,
                 "wall_s": time.perf_counter() - started}
        self.progress.eval_history.append(entry)
        if self.metrics is not None:
            self.metrics.write({"event": "eval", "split": "validation", "samples": len(self.eval_set), **entry})
        if self.env.is_main:
            logger.info("eval step %d: validation accuracy %.4f", self.progress.step, accuracy)
        if best_before is None or accuracy > best_before:
            self._save_best_validation(accuracy)

    def _best_validation_dir(self) -> Path:
        return self.checkpoint_dir / BEST_VALIDATION_DIR

    def _save_best_validation(self, accuracy: float) -> None:
        """Keep the weights of the best validation accuracy so far (with checkpoints on), for one test at the end.

        ``evaluate`` has just given every rank the whole current model, so rank 0 writes it alone; a failed write
        stops every rank with its message, as a checkpoint's does."""
        if not self.config.checkpoint.enabled:
            return
        error = ""
        if self.env.is_main:
            weights = {name: t.detach().contiguous() for name, t in self.model.state_dict().items()}
            try:
                save_checkpoint(self._best_validation_dir(), self.progress.step, weights, {},
                                {"validation_accuracy": accuracy}, keep=1)
            except CheckpointError as failure:
                error = str(failure)
        raise_together(error, CheckpointError)

    def _test(self) -> dict[str, Any]:
        """The one evaluation of the test split: the final model, then the best-validation one when it was kept
        (rank 0 reads it and hands it to the others, so every rank tests the same weights or none does)."""
        result: dict[str, Any] = {"test_accuracy": self.evaluate(self.test_set), "test_samples": len(self.test_set),
                                  "test_accuracy_at_best_validation": None, "best_validation_step": None}
        best = (latest_valid_checkpoint(self._best_validation_dir())
                if self.config.checkpoint.enabled and self.env.is_main else None)
        step = int(broadcast_string(str(best.step) if best is not None else "-1"))
        if step >= 0:
            weights = broadcast_tensors(best.weights if best is not None else None)
            with torch.no_grad():
                self.model.load_state_dict(weights)
            result["test_accuracy_at_best_validation"] = self.evaluate(self.test_set)
            result["best_validation_step"] = step
        if self.metrics is not None:
            self.metrics.write({"event": "test", "step": self.progress.step, **result})
        if self.env.is_main:
            logger.info("test accuracy %.4f (final model), %s at best validation", result["test_accuracy"],
                        result["test_accuracy_at_best_validation"])
        return result

    # ----------------------------------------------------------------------------------- loop
    def fit(self) -> dict[str, Any]:
        started = self._started = time.perf_counter() - self.progress.elapsed_before_s
        timer = StepTimer(self.env.device)
        cfg = self.config.train
        bar = (_progress_bar(self._total_samples(), self._samples_done())
               if self.env.is_main and self.config.run.progress else None)
        resumed_mid_epoch = self.progress.step > 0 and not self.progress.epoch_done
        first_epoch = self.progress.epoch + (1 if self.progress.epoch_done else 0)
        done = cfg.max_steps is not None and self.progress.step >= cfg.max_steps
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if _main_thread() else None
        try:
            for epoch in range(first_epoch, cfg.epochs):
                if done:
                    break
                self.progress.epoch, self.progress.epoch_done = epoch, False
                if not (resumed_mid_epoch and epoch == first_epoch):
                    self.sampler.set_epoch(epoch)
                while not done:
                    timer.reset()
                    with timer.phase("data"):
                        global_batch = self.sampler.next_global_batch(
                            self._global_batch_size(self.held.plan.layout.dp_width))
                    if global_batch is None:
                        break
                    loss = self._train_step(global_batch, timer)
                    self.progress.step += 1
                    self.progress.samples += len(global_batch)
                    self._log_step(loss, len(global_batch), timer.total(), timer, bar)
                    decision = self.policy.decide(self.progress.step, epoch, epoch_end=False)
                    if decision is not None:
                        self._apply_decision(decision)
                    if cfg.eval_every_steps and self.progress.step % cfg.eval_every_steps == 0:
                        self._record_eval(started)
                    done = cfg.max_steps is not None and self.progress.step >= cfg.max_steps
                    every = self.config.checkpoint.every_steps
                    periodic = every and self.progress.step % every == 0
                    mid_epoch = not self._epoch_exhausted()  # at an epoch's end the epoch-end checkpoint follows
                    if self._stop_requested or (mid_epoch and (periodic or done)):
                        self.save_checkpoint(started)
                    if self._stop_requested:
                        logger.warning("SIGTERM: checkpoint written at step %d, stopping", self.progress.step)
                        return self._finish(started, completed=False)
                if done and not self._epoch_exhausted():  # max_steps mid-epoch: a resume goes on with this epoch
                    break
                if not cfg.eval_every_steps:
                    self._record_eval(started)
                # Applied even on the last step: a checkpoint's policy state is always the model's frozen state.
                decision = self.policy.decide(self.progress.step, epoch, epoch_end=True)
                if decision is not None:
                    self._apply_decision(decision)
                self.progress.epoch_done = True
                if bar is not None:
                    bar.update(self._samples_done() - bar.n)  # a dropped tail counts as done
                self.save_checkpoint(started)
            if not self.progress.eval_history or self.progress.eval_history[-1]["step"] != self.progress.step:
                self._record_eval(started)  # the final model, whatever eval_every_steps is
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if bar is not None:
                bar.close()
        return self._finish(started)

    def _epoch_exhausted(self) -> bool:
        left = self.sampler.remaining()
        return left == 0 or (self.sampler.drop_last and left < self._global_batch_size(self.held.plan.layout.dp_width))

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Checkpoint at the next step boundary, then stop.

        Only a request: the ranks agree on the step through the next control vector. Acting on it here
        directly would let a signal that lands between a step's control all-reduce and the stop check
        stop this rank one step before the others, which then wait for it until the timeout.
        """
        self._sigterm_received = True

    def _finish(self, started: float, completed: bool = True) -> dict[str, Any]:
        """The summary; a completed run also evaluates the test split (outside its wall time)."""
        summary = self._summary(time.perf_counter() - started)
        if self.config.run.save_model:
            self.save_model(self.run_dir)
        if completed:
            summary.update(self._test())
        if self.env.is_main:
            write_json(self.run_dir / "summary.json", summary)
        return summary

    # ----------------------------------------------------------------------------------- checkpoints
    def _meta(self, started: float) -> dict[str, Any]:
        progress = dict(self.progress.__dict__)
        progress["elapsed_before_s"] = time.perf_counter() - started
        return {
            "step": self.progress.step,
            "epoch": self.progress.epoch,
            "sampler": self.sampler.state_dict(),
            "policy": self.policy.state_dict(),
            "progress": progress,
            "initial_width": self.initial_width,
            "world_size": self.env.world_size,
            META_CONFIG_KEY: config_to_dict(self.config),
            META_FINGERPRINT_KEY: model_fingerprint(self.model.state_dict()),
        }

    def save_checkpoint(self, started: float) -> None:
        """Gather the layout-independent state on rank 0 and write it atomically (all ranks must call); if the
        write fails, every rank raises its CheckpointError."""
        if not self.config.checkpoint.enabled:
            return
        weights, optimizer = self.gather_state()
        saved, error = None, ""
        if self.env.is_main:
            try:
                saved = save_checkpoint(self.checkpoint_dir, self.progress.step, weights, optimizer,
                                        self._meta(started), keep=self.config.checkpoint.keep)
            except CheckpointError as failure:
                error = str(failure)
        raise_together(error, CheckpointError)
        if saved is None:
            return
        record = {"step": saved.step, "bytes": saved.bytes_written, "seconds": saved.seconds, "path": str(saved.path)}
        self.progress.checkpoints.append(record)
        if self.metrics is not None:
            self.metrics.write({"event": "checkpoint", **record})
            self.metrics.flush()  # the events up to this checkpoint survive a kill; a resume continues from here

    def _resume_checkpoint(self) -> Checkpoint | None:
        """The checkpoint to resume from (``checkpoint.resume``), the same one on every rank.

        Rank 0 alone reads and verifies it and hands it to the others; a checkpoint that cannot be read or
        used makes every rank raise the same CheckpointError.
        """
        resume = self.config.checkpoint.resume
        if resume is None:
            return None
        checkpoint, error = None, ""
        if self.env.is_main:
            try:
                checkpoint = (latest_valid_checkpoint(self.checkpoint_dir) if resume == "auto"
                              else load_checkpoint(Path(resume)))
            except CheckpointError as failure:
                error = str(failure)
        raise_together(error, CheckpointError)
        path = broadcast_string(str(checkpoint.path) if checkpoint is not None else "")
        if not path:
            logger.info("no checkpoint in %s: starting from scratch", self.checkpoint_dir)
            return None
        meta = json.loads(broadcast_string(json.dumps(checkpoint.meta) if checkpoint is not None else ""))
        error = ""
        try:  # on every rank: its own model and config
            check_compatible(meta, model_fingerprint=model_fingerprint(self.model.state_dict()),
                             config=config_to_dict(self.config))
        except CheckpointError as failure:
            error = str(failure)
        raise_together(error, CheckpointError)
        weights = broadcast_tensors(checkpoint.weights if checkpoint is not None else None)
        optimizer = broadcast_tensors(checkpoint.optimizer if checkpoint is not None else None)
        return Checkpoint(Path(path), int(meta["step"]), weights, optimizer, meta)

    def _restore(self, checkpoint: Checkpoint) -> None:
        meta = checkpoint.meta
        with torch.no_grad():
            self.model.load_state_dict(checkpoint.weights)
        self.policy.load_state_dict(meta["policy"])
        if self.policy.frozen:
            freeze_blocks(self.model, frozen_blocks(self.policy.frozen, self.model.num_layers), None)
        self.sampler.load_state_dict(meta["sampler"])
        progress = dict(meta["progress"])
        progress["restarts"] = int(progress.get("restarts", 0)) + 1
        self.progress = _Progress(**progress)
        self.progress.layout_history = list(self.progress.layout_history)
        if meta["world_size"] == self.env.world_size:
            self.initial_width = meta["initial_width"]
        logger.info("resumed from %s (step %d, epoch %d)", checkpoint.path, self.progress.step, self.progress.epoch)

    def _truncate_sample_logs(self) -> None:
        """Cut each rank's sample log back to the checkpoint (the rank's own, and rank 0 those of ranks this run
        no longer has), so a step the killed attempt trained after it is recorded once."""
        for path in self.run_dir.glob(f"{SAMPLE_LOG_PREFIX}*.jsonl"):
            rank = int(path.stem.removeprefix(SAMPLE_LOG_PREFIX))
            if rank == self.env.rank or (self.env.is_main and rank >= self.env.world_size):
                truncate_log(path, self.progress.step)

    def _restore_optimizer(self, state: dict[str, torch.Tensor]) -> None:
        """Install the checkpoint's "<param name>.<state key>" tensors for the held parameters, whatever the keys."""
        if self.optimizer is None:
            return
        saved: dict[str, dict[str, torch.Tensor]] = {}
        for full_name, tensor in state.items():
            name, _, key = full_name.rpartition(".")  # state keys have no dots, parameter names do
            saved.setdefault(name, {})[key] = tensor
        names = {id(p): n for n, p in self.model.named_parameters()}
        for param in self._held_params(self.held):
            if names[id(param)] in saved:
                self.optimizer.state[param] = place_state(param, saved[names[id(param)]])

    def gather_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The layout-independent training state on rank 0: every block's parameters and persistent buffers,
        and the optimizer state of every trainable parameter, keyed by name (other ranks get empty dicts)."""
        plan = self.held.plan
        received: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        if self.env.distributed:
            owners = {b: plan.layout.rank(0, s) for s, (start, end) in enumerate(plan.held_bounds())
                      for b in range(start, end)}
            transfers = [BlockTransfer(b, owner, 0) for b, owner in sorted(owners.items()) if owner != 0]
            received = transfer_blocks(self.model, transfers, self.optimizer, self.env.rank)
        if not self.env.is_main:
            return {}, {}
        own = self.optimizer.state if self.optimizer is not None else {}
        weights = {name: tensor.detach().clone().contiguous() for name, tensor in self.model.state_dict().items()}
        optimizer = {}
        for name, param in self.model.named_parameters():
            state = received.get(param) or own.get(param)
            if param.requires_grad and state:
                for key, value in state_tensors(param, state).items():
                    optimizer[f"{name}.{key}"] = value.detach().clone().contiguous()
        return weights, optimizer

    def save_model(self, directory: Path) -> None:
        """Every block's weights and all optimizer state, written as checkpoint files are (all ranks must call)."""
        weights, optimizer = self.gather_state()
        error = ""
        if self.env.is_main:
            try:
                write_tensors(directory / "model.safetensors", weights, "model")
                write_tensors(directory / "optimizer.safetensors", optimizer, "optimizer")
            except CheckpointError as failure:
                error = str(failure)
        raise_together(error, CheckpointError)

    def _log_step(self, loss: float, samples: int, step_s: float, timer: StepTimer, bar: Any) -> None:
        layout = self.held.plan.layout
        if bar is not None:
            bar.update(samples)
            bar.set_postfix_str(f"loss {loss:.3f} | {samples / step_s:.1f} samples/s | frozen "
                                f"{len(self.policy.frozen)} | stages {layout.num_stages} x dp {layout.dp_width}")
        if self.metrics is None:
            return
        step = self.progress.step
        if step % self.config.run.log_every and step != 1:
            return
        record = {"event": "step", "step": step, "epoch": self.progress.epoch, "loss": loss,
                  "lr": self._lr,
                  "samples_per_s": samples / step_s, "step_s": step_s, "global_batch": samples,
                  "frozen_layers": len(self.policy.frozen), "stages": layout.num_stages, "dp_width": layout.dp_width,
                  "micro_batches": self.held.plan.micro_batches, "allreduce_bytes": self._allreduce_bytes,
                  "layer_grad_norms": self._layer_norms,
                  "wall_s": time.perf_counter() - self._started, **timer.as_record()}
        if self._layer_dots is not None:
            record["layer_grad_dots"] = self._layer_dots
        if self.cache is not None:
            m = self.cache.metrics()
            record.update({"cache_hit_rate": m.hit_rate, "cache_memory_bytes": m.memory_used_bytes,
                           "cache_disk_bytes": m.disk_used_bytes, "cache_seconds_saved": m.seconds_saved})
        self.metrics.write(record)

    def _fingerprints(self) -> list[list[float]]:
        """Per rank: [stage, sum of its held parameters in float64]. Replicas of a stage must agree bit for bit."""
        start, end = self.held.blocks
        total = sum(float(p.detach().double().sum()) for i in range(start, end)
                    for p in self.model.blocks[i].parameters())
        mine = torch.tensor([-1.0 if self.held.stage is None else float(self.held.stage), total], dtype=torch.float64)
        if not self.env.distributed:
            return [mine.tolist()]
        gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, mine)
        return [g.tolist() for g in gathered]

    def _summary(self, wall_s: float) -> dict[str, Any]:
        evals = self.progress.eval_history
        return {
            "rank_fingerprints": self._fingerprints(),
            "eval_accuracy": evals[-1]["accuracy"] if evals else None,
            "best_eval_accuracy": max((e["accuracy"] for e in evals), default=None),
            "eval_history": evals,
            "wall_time_s": wall_s,
            "train_samples": self.progress.samples,
            "steps": self.progress.step,
            "world_size": self.env.world_size,
            "layout_history": self.progress.layout_history,
            "transitions": self.progress.transitions,
            "freeze_decisions": self.progress.freeze_decisions,
            "freeze_cap_binds": self.policy.cap_binds,
            "samples_per_s": self.progress.samples / wall_s if wall_s > 0 else None,
            "restarts": self.progress.restarts,
            "checkpoints": self.progress.checkpoints,
            "run_dir": str(self.run_dir),
        }

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.store is not None:
            self.store.close()
        self._destroy_groups()
        shutdown_distributed()


@dataclass(frozen=True)
class _Bounds:
    bounds: list[tuple[int, int]]


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


def _dump_yaml(values: dict[str, Any]) -> str:
    import yaml
    return yaml.safe_dump(values, sort_keys=False)


def _layout_to_json(layout: StoreLayout) -> str:
    return json.dumps({"name": layout.name, "num_samples": layout.num_samples,
                       "shapes": [list(s) for s in layout.spec.shapes],
                       "dtypes": [str(d).removeprefix("torch.") for d in layout.spec.dtypes],
                       "memory_path": layout.memory_path, "memory_records": layout.memory_records,
                       "disk_path": layout.disk_path, "disk_records": layout.disk_records})


def _layout_from_json(text: str) -> StoreLayout:
    from .models.blocks import ActivationSpec
    values = json.loads(text)
    spec = ActivationSpec(tuple(tuple(s) for s in values["shapes"]),
                          tuple(getattr(torch, d) for d in values["dtypes"]))
    return StoreLayout(values["name"], values["num_samples"], spec, values["memory_path"], values["memory_records"],
                       values["disk_path"], values["disk_records"])


def _progress_bar(total: int, initial: int) -> Any:
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, dynamic_ncols=True, mininterval=1.0)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def train(config: Config) -> dict[str, Any]:
    """Python API: run ``config`` in this process (join a torchrun job if launched by one)."""
    trainer = Trainer(config)
    try:
        return trainer.fit()
    finally:
        trainer.close()
