"""Typed run configuration: YAML file + ``--set key=value`` overrides, validated field by field.

Every field is documented where it is declared. Validation errors are one line and name the key and the
allowed values, so a typo never silently runs the wrong job.
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = ["BYTES_PER_GB", "BYTES_PER_MIB", "LANGUAGE_MODEL_KINDS", "UNWINDOWED", "Config", "ConfigError", "load_config",
           "apply_overrides", "check_freeze_values", "config_from_dict", "config_to_dict"]

BYTES_PER_GB = 1e9
"""The ``*_gb`` settings are decimal gigabytes."""
BYTES_PER_MIB = 2**20
"""``dp.bucket_mib`` is in binary mebibytes, as DDP's ``bucket_cap_mb``."""
UNWINDOWED = ("schedule", "none")
"""Freeze policies without decision windows: ``interval`` does not apply (a schedule's ``at`` counts steps or epochs)."""
LEARNED_BY = ("any_layer", "layer")
"""Whose window of learning starts a layer's coherence test: any layer's (the default), or its own."""
PERCENT = 100.0
USABLE_MEMORY_FRACTION = 0.9
"""Share of a device's memory a plan fills when ``pipe.device_memory_gb`` is unset; the rest is an assumed allowance
for the CUDA context, allocator fragmentation and communication buffers."""
RUNS_DIR = "runs"
DEFAULT_RUN_NAME = "run"


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change, on one line (keys may hold newlines)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))


def _require(rule: str, holds: Callable[[Any], bool], values: dict[str, Any]) -> None:
    """Raise for the first ``key: value`` that breaks ``rule`` (the words the error gives, e.g. ``>= 1 or null``)."""
    for key, value in values.items():
        if not holds(value):
            raise ConfigError(f"{key} must be {rule}, got {value}")


class _Loader(yaml.SafeLoader):
    """Safe YAML that also reads ``1e-4`` as a number: YAML 1.1 (PyYAML) wants ``1.0e-4``, people write both."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


@dataclass
class RunConfig:
    dir: str | None = None  # run directory; default runs/<config name>-<timestamp>
    name: str | None = None  # defaults to the config file's stem
    log_every: int = 10  # steps between metrics.jsonl records (1 = every step)
    progress: bool = True  # progress bar on rank 0, in samples
    save_model: bool = False  # also write optimizer.safetensors at the end (model.safetensors, the final weights, is always written)
    record_samples: bool = False  # write samples-rank<R>.jsonl: the sample indices each replica trained on, per step
    tensorboard: bool = True  # rank 0 also logs TensorBoard event files to <run dir>/tensorboard, if installed
    profile_steps: list[int] | None = None  # [first, last]: torch.profiler over these steps (1-based), per rank into <run dir>/profile: ops by self time, a Chrome trace, per-step counts of ops, kernel launches and host syncs

    def resolved_dir(self) -> str:
        """``dir``, or ``runs/<name>-<time>``: named once, by the launcher for its workers or by rank 0 alone."""
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        return self.dir or str(Path(RUNS_DIR) / f"{self.name or DEFAULT_RUN_NAME}-{stamp}")


LANGUAGE_MODEL_KINDS = ("decoder", "hf_decoder")
"""``model.kind`` values that train a causal language model (the task ``causal_lm``) rather than a classifier."""


@dataclass
class ModelConfig:
    kind: Literal["minilm", "hf", "vit", "decoder", "hf_decoder"] = "minilm"  # packaged pretrained MiniLM, any HF encoder, built-in ViT, built-in causal decoder, a Hugging Face causal LM (GPT-2- or Llama-style; the last two are language models)
    path: str | None = None  # kind=hf: local directory of a pretrained encoder; kind=vit: a backbone from `pipetransformer pretrain`; kind=decoder: an earlier decoder run's model.safetensors (fine-tuning it); kind=hf_decoder: local directory of a causal LM and its tokenizer (required)
    hf_config: dict[str, Any] | None = None  # kind=hf: config dict (with model_type) for random weights
    pooling: Literal["mean", "cls"] = "mean"  # text head: masked mean of tokens, or the first token
    attn_implementation: Literal["eager", "sdpa"] = "sdpa"  # HF attention kernel (same speed on CPU here)
    vit: dict[str, Any] = field(default_factory=dict)  # kind=vit: build_vit keyword arguments
    decoder: dict[str, Any] = field(default_factory=dict)  # kind=decoder: build_decoder keyword arguments

    @property
    def pretrained(self) -> bool:
        """Whether the model starts from trained weights (MiniLM, or a ``path``), not a random initialisation."""
        return self.kind == "minilm" or self.path is not None


@dataclass
class DataConfig:
    name: Literal["rotten_tomatoes", "text_csv", "fashion_mnist", "digits", "image_folder"] = "rotten_tomatoes"  # see README
    path: str | None = None  # text_csv: the CSV file; image_folder: the folder
    test_path: str | None = None  # text_csv: a CSV of test rows (same columns); null = a seeded test split of path
    text_column: str = "text"  # text_csv: the column holding the text
    label_column: str = "label"  # text_csv: the column holding the label: class names, whatever they look like ("1" and "5" make 2 classes)
    response_column: str | None = None  # model.kind=decoder or hf_decoder with text_csv: instruction data, one example a row: the text_column is the prompt, this column the response, and the loss reads the response's tokens only (null: the text_column's text, packed)
    encoding: str = "utf-8"  # text_csv: the CSV files' text encoding (e.g. latin-1, cp1252)
    max_length: int = 64  # text: tokens per sample (batches are trimmed to their longest)
    split_seed: int = 0  # fixes the validation/test split and the subsets, apart from seed: every training seed is scored on the same data
    validation_fraction: float = 0.1  # of the training data: evaluations during training, best-model selection, tuning
    test_fraction: float = 0.1  # of the data, when the data set has no test split of its own; evaluated once, at the end
    max_train_samples: int | None = None  # seeded subset, for quick runs
    max_eval_samples: int | None = None  # seeded subset of the validation split
    max_test_samples: int | None = None  # seeded subset of the test split


@dataclass
class TrainConfig:
    epochs: int = 1  # passes over the training set
    max_steps: int | None = None  # stop (with a checkpoint) after this many optimizer steps; the lr schedule still spans epochs
    batch_size: int = 32  # global batch (all replicas together)
    optimizer: Literal["adamw", "sgd"] = "adamw"  # state moves with its parameters at layout changes
    lr: float = 5e-5  # peak learning rate
    weight_decay: float = 0.01  # decoupled (AdamW); frozen parameters leave the optimizer
    momentum: float = 0.9  # sgd only
    lr_schedule: Literal["linear", "cosine", "constant"] = "linear"  # decay after warm-up
    warmup_fraction: float = 0.06  # of the schedule, which spans train.epochs in samples
    layer_lr_decay: float = 1.0  # block i of n trains at lr * decay^(n-1-i) (head: full rate); 1 = off
    grad_clip: float | None = 1.0  # global gradient-norm clip; null = off
    eval_every_steps: int | None = None  # null = at every epoch end; N = every N steps (not at epoch ends)
    eval_batch_size: int = 128  # evaluation is sharded over every worker
    drop_last: bool = False  # drop an epoch's short last batch instead of training on it
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: forwards under bf16 autocast; weights, gradients and optimizer state stay fp32


@dataclass
class DistConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on cuda, gloo on cpu
    timeout_s: float = 300.0  # every collective fails instead of hanging past this
    threads_per_worker: int | None = None  # torch threads per worker; default cores / local workers


@dataclass
class FreezeConfig:
    """AutoFreeze. The defaults are the tuned result (benchmarks/freeze_transfer): set ``enabled`` and nothing else.

    These fields own every freeze default: the Python API (``freeze.make_policy``) takes them by reference."""

    enabled: bool = False  # AutoFreeze
    policy: Literal["descent", "coherence", "gradient", "geometric", "schedule", "random", "none"] = "descent"  # descent: freeze the layers whose updates no longer lower the loss on new batches; coherence: whose gradient turned to noise; gradient: the paper's test
    prior: int | Literal["auto", "none", "embeddings"] = "none"  # frozen from the first step: none; auto = the embeddings and a third of the layers (rounded down) for pretrained weights, nothing for random init; k = the embeddings and the bottom k layers
    interval: int | float = 0.05  # decision window length, in interval_unit (a fraction in (0, 1] for fraction)
    interval_unit: Literal["steps", "epochs", "fraction"] = "fraction"  # fraction: of the run's planned steps
    min_window_steps: int = 10  # interval_unit fraction: no window shorter than this many steps
    alpha: float = 1 / 3  # geometric and random policies: fraction of the remaining layers frozen per decision
    descent_threshold: float = -1.0  # descent policy: a layer whose descent t-statistic stays below this for two windows (after the model learned) has stopped learning; lower freezes less
    threshold: float = 0.2  # coherence policy: a layer whose gradient coherence stays below this (after it learned) has converged
    max_advance: int | None = None  # descent and coherence policies: at most this many more layers freeze per decision (null: every layer the test found stopped, within the caps)
    learned_by: Literal["any_layer", "layer"] = "any_layer"  # coherence policy: whose window of learning starts a layer's test (any layer's, or its own)
    learned_min_steps: int = 20  # coherence policy: steps of consecutive windows at or above threshold before a layer counts as having learned (two windows of the 10-step floor; a longer window counts alone)
    percentile: float = 50.0  # gradient policy threshold
    max_change: float | None = None  # gradient policy: a layer whose change ratio is at or above this never counts as converged
    evidence_max_fraction: float | None = 0.5  # descent, coherence and gradient: at most this share of the layers frozen, the prior's included (the top layers keep training; null: the learning-rate budget alone)
    early_max_fraction: float | None = None  # descent policy: the test may freeze up to this share of the layers as soon as it finds them stopped; deeper, up to evidence_max_fraction, only within the learning-rate budget (a layer frozen with a share r of the learning rate to come forgoes that share of its updates; null: no budget below evidence_max_fraction)
    jitter_max_share: float | None = 0.5  # descent policy: the frozen prefix may hold at most this share of the model's jitter (per layer the loss its own updates add on new batches, -mean descent, in the last window before the first freeze): where the jitter sits, annealing still gains, so freezing stops short of it (null: no such bound)
    max_fraction: float | None = None  # a cap on the fraction of the layers any deciding policy freezes (null: none; coherence and gradient are bounded by the learning rate the run has spent)
    schedule: list[list[int]] | None = None  # policy=schedule: [[at, frozen_layers], ...] (at in steps or epochs)

    def check(self) -> None:
        """The values single field types cannot express; the bound by the model's layer count is the policy's."""
        if self.policy not in UNWINDOWED:  # they read no windows (a schedule counts steps or epochs)
            if self.interval_unit == "fraction":
                if not 0.0 < self.interval <= 1.0:
                    raise ConfigError(f"freeze.interval must be in (0, 1] with interval_unit: fraction (0.05 = every "
                                      f"5% of the run), got {self.interval}")
            elif not isinstance(self.interval, int) or self.interval < 1:
                raise ConfigError(f"freeze.interval must be an integer >= 1 with interval_unit: {self.interval_unit}, "
                                  f"got {self.interval}; for a share of the run set interval_unit: fraction")
        if self.min_window_steps < 1:
            raise ConfigError(f"freeze.min_window_steps must be >= 1, got {self.min_window_steps}")
        if isinstance(self.prior, int) and self.prior < 0:
            raise ConfigError(f"freeze.prior must be auto, none, embeddings or a layer count >= 0, got {self.prior}")
        check_freeze_values(alpha=self.alpha, percentile=self.percentile, max_fraction=self.max_fraction,
                            evidence_max_fraction=self.evidence_max_fraction, max_change=self.max_change,
                            threshold=self.threshold, max_advance=self.max_advance, learned_by=self.learned_by,
                            learned_min_steps=self.learned_min_steps, descent_threshold=self.descent_threshold,
                            early_max_fraction=self.early_max_fraction, jitter_max_share=self.jitter_max_share)
        if self.policy == "schedule" and self.enabled and not self.schedule:
            raise ConfigError("freeze.policy=schedule needs freeze.schedule: [[at, frozen_layers], ...]")
        previous: list[int] | None = None
        for entry in self.schedule or []:
            if len(entry) != 2 or min(entry) < 0:
                raise ConfigError(f"freeze.schedule entries are [at, frozen_layers] pairs of integers >= 0, "
                                  f"got {entry}")
            if previous is not None and (entry[0] <= previous[0] or entry[1] < previous[1]):
                raise ConfigError(f"freeze.schedule must have at increasing and frozen_layers never decreasing: "
                                  f"{previous} is followed by {entry}")
            previous = entry


def check_freeze_values(*, alpha: float, percentile: float, max_fraction: float | None,
                        evidence_max_fraction: float | None, max_change: float | None,
                        threshold: float, max_advance: int | None, learned_by: str, learned_min_steps: int,
                        descent_threshold: float = 0.0, early_max_fraction: float | None = None,
                        jitter_max_share: float | None = None) -> None:
    """The freeze settings' ranges, checked once for the config and the Python API (``freeze.make_policy``)."""
    if early_max_fraction is not None and not 0.0 <= early_max_fraction <= 1.0:
        raise ConfigError(f"freeze.early_max_fraction must be in [0, 1] (or null), got {early_max_fraction}")
    if jitter_max_share is not None and not 0.0 <= jitter_max_share <= 1.0:
        raise ConfigError(f"freeze.jitter_max_share must be in [0, 1] (or null), got {jitter_max_share}")
    if not math.isfinite(descent_threshold):
        raise ConfigError(f"freeze.descent_threshold must be a finite number (a t-statistic), got {descent_threshold}")
    if not 0.0 < threshold < 1.0:
        raise ConfigError(f"freeze.threshold must be in (0, 1), got {threshold}")
    if max_advance is not None and max_advance < 1:
        raise ConfigError(f"freeze.max_advance must be >= 1 (or null), got {max_advance}")
    if learned_by not in LEARNED_BY:
        raise ConfigError(f"freeze.learned_by must be one of {', '.join(LEARNED_BY)}, got {learned_by!r}")
    if learned_min_steps < 1:
        raise ConfigError(f"freeze.learned_min_steps must be >= 1, got {learned_min_steps}")
    if not 0.0 < alpha <= 1.0:
        raise ConfigError(f"freeze.alpha must be in (0, 1], got {alpha}")
    if not 0.0 <= percentile <= PERCENT:
        raise ConfigError(f"freeze.percentile must be in [0, 100], got {percentile}")
    if max_change is not None and max_change <= 0.0:
        raise ConfigError(f"freeze.max_change must be > 0 (or null for the percentile alone), got {max_change}")
    if max_fraction is not None and not 0.0 <= max_fraction <= 1.0:
        raise ConfigError(f"freeze.max_fraction must be in [0, 1] (or null), got {max_fraction}")
    if evidence_max_fraction is not None and not 0.0 < evidence_max_fraction <= 1.0:
        raise ConfigError(f"freeze.evidence_max_fraction must be in (0, 1] (or null), got {evidence_max_fraction}")


@dataclass
class PipeConfig:
    enabled: bool = False  # AutoPipe: pipeline stages over the workers, re-partitioned as layers freeze
    stages: int | Literal["auto"] = "auto"  # auto: fewest stages that fit device_memory_gb
    micro_batches: int | Literal["auto"] = "auto"  # auto: from the cost model (bubble vs the blocks' costs per call)
    schedule: Literal["gpipe", "1f1b"] = "gpipe"  # torch.distributed.pipelining schedule
    device_memory_gb: float | None = None  # per-device budget for the partitioner (CPU: a budget you set)
    link_bandwidth_gbps: float = 10.0  # stage-to-stage bandwidth assumed by the cost model (GB/s)
    profile: bool = True  # measure block costs on the device (per sample and per call); false = analytical estimate
    recompute: bool = False  # the planner may recompute chosen blocks' activations in backward to fit device_memory_gb, when predicted faster than another stage

    def memory_budget_bytes(self, device_memory_bytes: float = math.inf) -> float:
        """What a plan may fill on one device: ``device_memory_gb``, or unset :data:`USABLE_MEMORY_FRACTION` of the
        device's memory, where that is known (``plan --cluster``); a run's workers do not know it, so unset is no
        limit there. The one reading of the setting, for the trainer's planner and the ``plan`` command."""
        if self.device_memory_gb is None:
            return device_memory_bytes * USABLE_MEMORY_FRACTION
        return int(self.device_memory_gb * BYTES_PER_GB)


@dataclass
class DPConfig:
    enabled: bool = False  # elastic: workers freed by pipeline compression become new replicas
    batch_policy: Literal["keep_global", "keep_per_pipeline"] = "keep_global"  # keep_per_pipeline: global batch and lr grow with the width (linear scaling)
    bucket_mib: float = 25.0  # gradients are all-reduced over a stage's replicas in buckets of this size (DDP's default)
    touched_rows_only: bool = True  # vocabulary-sized embedding tables: all-reduce only the rows some replica's batch touched (exact)


@dataclass
class CacheConfig:
    enabled: bool = False  # AutoCache: frozen prefix output per sample, computed once
    min_frozen: int = 1  # frozen layers needed before the cache starts
    memory_gb: float = 2.0  # shared-memory level budget; the rest spills to dir
    dir: str | None = None  # disk level, per node; default node-local temporary storage (TMPDIR, else /tmp)


RESUME_AUTO = "auto"
"""``checkpoint.resume`` value: the newest valid checkpoint in the run, if any."""


@dataclass
class CheckpointConfig:
    enabled: bool = True  # at epoch ends, every every_steps, and on SIGTERM
    every_steps: int | None = None  # null = only at epoch ends (and on SIGTERM)
    keep: int = 2  # newest valid checkpoints kept
    dir: str | None = None  # default <run dir>/checkpoints; on several nodes, storage every node sees
    resume: str | None = None  # "auto" (newest valid checkpoint, if any) or a checkpoint directory


@dataclass
class Config:
    seed: int = 0
    deterministic: bool = False  # torch deterministic algorithms (exact resume checks)
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    pipe: PipeConfig = field(default_factory=PipeConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> None:
        """Cross-field checks that single field types cannot express."""
        _require(">= 1", lambda value: value >= 1, {
            "train.epochs": self.train.epochs,
            "train.batch_size": self.train.batch_size,
            "train.eval_batch_size": self.train.eval_batch_size,
            "data.max_length": self.data.max_length,
            "run.log_every": self.run.log_every,
            "checkpoint.keep": self.checkpoint.keep,
        })
        _require(">= 1 or null", lambda value: value is None or value >= 1, {
            "train.max_steps": self.train.max_steps,
            "data.max_train_samples": self.data.max_train_samples,
            "data.max_eval_samples": self.data.max_eval_samples,
            "data.max_test_samples": self.data.max_test_samples,
            "train.eval_every_steps": self.train.eval_every_steps,
            "checkpoint.every_steps": self.checkpoint.every_steps,
            "dist.threads_per_worker": self.dist.threads_per_worker,
        })
        _require("> 0", lambda value: value > 0, {
            "train.lr": self.train.lr,
            "dist.timeout_s": self.dist.timeout_s,
            "pipe.link_bandwidth_gbps": self.pipe.link_bandwidth_gbps,
            "dp.bucket_mib": self.dp.bucket_mib,
        })
        steps = self.run.profile_steps
        if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise ConfigError(f"run.profile_steps must be [first, last] with 1 <= first <= last (steps count from 1), "
                              f"got {steps}")
        if self.train.weight_decay < 0:
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.train.weight_decay}")
        if not 0.0 <= self.train.momentum < 1.0:
            raise ConfigError(f"train.momentum must be in [0, 1), got {self.train.momentum}")
        if self.train.grad_clip is not None and self.train.grad_clip <= 0:
            raise ConfigError(f"train.grad_clip must be > 0, or null for no clipping, got {self.train.grad_clip}")
        if not 0.0 < self.train.layer_lr_decay <= 1.0:
            raise ConfigError(f"train.layer_lr_decay must be in (0, 1] (1 = every block at train.lr), "
                              f"got {self.train.layer_lr_decay}")
        if not 0.0 <= self.train.warmup_fraction < 1.0:
            raise ConfigError(f"train.warmup_fraction must be in [0, 1), got {self.train.warmup_fraction}")
        for key, fraction in (("data.validation_fraction", self.data.validation_fraction),
                              ("data.test_fraction", self.data.test_fraction)):
            if not 0.0 < fraction < 1.0:
                raise ConfigError(f"{key} must be in (0, 1), got {fraction}")
        if self.data.validation_fraction + self.data.test_fraction >= 1.0:
            raise ConfigError(f"data.validation_fraction + data.test_fraction must be < 1 so training keeps data, got "
                              f"{self.data.validation_fraction} + {self.data.test_fraction}")
        self.freeze.check()
        if isinstance(self.pipe.stages, int) and self.pipe.stages < 1:
            raise ConfigError(f"pipe.stages must be 'auto' or >= 1, got {self.pipe.stages}")
        if isinstance(self.pipe.micro_batches, int) and self.pipe.micro_batches < 1:
            raise ConfigError(f"pipe.micro_batches must be 'auto' or >= 1, got {self.pipe.micro_batches}")
        if self.pipe.device_memory_gb is not None and self.pipe.device_memory_gb <= 0:
            raise ConfigError(f"pipe.device_memory_gb must be > 0 or null, got {self.pipe.device_memory_gb}")
        if self.cache.memory_gb < 0:
            raise ConfigError(f"cache.memory_gb must be >= 0, got {self.cache.memory_gb}")
        if self.cache.min_frozen < 1:
            raise ConfigError(f"cache.min_frozen must be >= 1, got {self.cache.min_frozen}")
        if self.pipe.recompute and not self.pipe.enabled:
            raise ConfigError("pipe.recompute is a lever of AutoPipe's planner: set pipe.enabled: true")
        if self.pipe.recompute and self.pipe.device_memory_gb is None:
            raise ConfigError("pipe.recompute trades speed for memory under pipe.device_memory_gb: set a budget, "
                              "or pipe.recompute: false")
        if self.pipe.recompute and self.pipe.stages == "auto" and self.pipe.enabled and not self.dp.enabled:
            raise ConfigError("pipe.recompute with pipe.stages: auto weighs stages against replicas: set "
                              "dp.enabled: true, or fix pipe.stages")
        if self.dp.enabled and not self.pipe.enabled:
            raise ConfigError("dp.enabled (elastic data parallelism) needs pipe.enabled: true, "
                              "because its replicas come from compressing the pipeline")
        if self.cache.enabled and not self.freeze.enabled:
            raise ConfigError("cache.enabled caches the frozen layers' output: set freeze.enabled: true too")
        text = self.data.name in ("rotten_tomatoes", "text_csv")
        if text == (self.model.kind == "vit"):
            raise ConfigError(f"data.name={self.data.name} does not fit model.kind={self.model.kind}: "
                              "use model.kind vit for image data and minilm/hf/decoder/hf_decoder for text")
        language_model = self.model.kind in LANGUAGE_MODEL_KINDS
        if self.data.response_column is not None and (not language_model or self.data.name != "text_csv"):
            raise ConfigError("data.response_column (instruction data) is for model.kind: decoder or hf_decoder with "
                              "data.name: text_csv: remove it, or set both")
        if self.data.name in ("text_csv", "image_folder") and not self.data.path:
            raise ConfigError(f"data.name={self.data.name} needs data.path")
        try:
            codecs.lookup(self.data.encoding)
        except LookupError:
            raise ConfigError(f"data.encoding: unknown encoding {self.data.encoding!r} (e.g. utf-8, latin-1, "
                              "cp1252)") from None
        if self.data.test_path is not None and self.data.name != "text_csv":
            raise ConfigError(f"data.test_path is for text_csv; data.name={self.data.name} has its test split built in "
                              "(image_folder: put test files in its folder)")
        if self.model.kind == "hf" and not (self.model.path or self.model.hf_config):
            raise ConfigError("model.kind=hf needs model.path (pretrained directory) or model.hf_config")
        if self.model.kind == "hf_decoder" and (not self.model.path or self.model.hf_config or self.model.decoder):
            raise ConfigError("model.kind=hf_decoder needs model.path, a local directory holding a causal language "
                              "model and its tokenizer, and no hf_config or decoder settings")

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


_SCALARS: dict[Any, tuple[str, Callable[[Any], bool]]] = {
    type(None): ("null", lambda value: value is None),
    bool: ("true or false", lambda value: isinstance(value, bool)),
    int: ("an integer", lambda value: isinstance(value, int) and not isinstance(value, bool)),
    str: ("a string", lambda value: isinstance(value, str)),
}
"""Field types taken as they are, each with the words its error gives and the values it accepts."""


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [option for option in typing.get_args(tp) if option is not type(None)]
        if value is None and len(options) < len(typing.get_args(tp)):
            return None
        if len(options) == 1:  # optional field: the inner type's message says more than "X | null"
            return _coerce(key, value, options[0])
        for option in options:
            try:
                return _coerce(key, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} is not a valid value (allowed: {_type_name(tp)})")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{key}: {value!r} is not allowed (allowed: {_type_name(tp)})")
    if tp in _SCALARS:
        expected, accepts = _SCALARS[tp]
        if accepts(value):
            return value
        raise ConfigError(f"{key}: expected {expected}, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{key}: expected a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_type,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", item, item_type) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    raise ConfigError(f"{key}: unsupported field type {tp}")


def _build(cls: Any, values: Any, prefix: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted((str(key) for key in set(values) - set(names)), key=str)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key '{where}{unknown[0]}' (allowed under '{prefix or 'top level'}': "
                          f"{', '.join(names)})")
    kwargs = {name: _coerce(f"{prefix}.{name}" if prefix else name, values[name], hints[name])
              for name in names if name in values}
    return cls(**kwargs)


def config_from_dict(values: dict[str, Any]) -> Config:
    config: Config = _build(Config, values, "")
    config.validate()
    return config


def config_to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` strings (values parsed as YAML) to a nested dict."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value (e.g. train.lr=1e-4), got {item!r}")
        try:
            value = _parse_yaml(raw) if raw else None
        except yaml.YAMLError as error:
            raise ConfigError(f"--set {key}: cannot parse {raw!r} as a value ({error.__class__.__name__})") from None
        node = values
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: '{part}' is not a section")
            node = child
        node[parts[-1]] = value
    return values


BASE_KEY = "base"
"""A config may name another YAML file (relative to itself) whose values it extends."""


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (shipped configs are in configs/)")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'base' files form a cycle: {' -> '.join(str(p) for p in seen)}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read it as a text file ({error.__class__.__name__}): "
                          "pass a YAML config") from None
    try:
        loaded = _parse_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: malformed YAML{where}: fix the syntax") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
    base = loaded.pop(BASE_KEY, None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ConfigError(f"{path}: 'base' must be a file name, got {base!r}")
    return _deep_merge(_read_yaml(path.parent / base, (*seen, path.resolve())), loaded)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or start from defaults when ``path`` is None) and apply overrides."""
    values: dict[str, Any] = _read_yaml(Path(path)) if path is not None else {}
    values = apply_overrides(values, overrides or [])
    config = config_from_dict(values)
    if config.run.name is None and path is not None:
        config.run.name = Path(path).stem
    return config
