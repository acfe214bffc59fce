"""What a run is made of, from its config: seeds, the run directory, the data splits, the block model."""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path

import torch

from pipetransformer.config import Config, ConfigError, RunConfig
from pipetransformer.data import datasets_from_config, small_split_warnings
from pipetransformer.data.batch import DataSplits, IndexedDataset
from pipetransformer.data.text import TextDataset
from pipetransformer.distributed import DistEnv, broadcast_string
from pipetransformer.models import BlockSequence, build_model, load_tokenizer, minilm_path
from pipetransformer.models.blocks import Activation
from pipetransformer.models.vit import vit_image_shape

__all__ = ["build_blocks", "example_inputs", "load_splits", "resolve_run_dir", "seed_everything"]

logger = logging.getLogger(__name__)

COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
"""``train.precision`` -> the autocast dtype of every forward (None: the weights' own fp32)."""
RUNS_DIR = "runs"
DEFAULT_RUN_NAME = "run"


def seed_everything(config: Config) -> None:
    torch.manual_seed(config.seed)
    if config.deterministic:
        torch.use_deterministic_algorithms(True)


def resolve_run_dir(settings: RunConfig) -> Path:
    """``run.dir``, or ``runs/<name>-<time>`` as rank 0 names it. Not created here: the run's recorder creates it
    once set-up has succeeded, so a run refused while setting up (its data, model or memory budget) leaves none."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = settings.dir or str(Path(RUNS_DIR) / f"{settings.name or DEFAULT_RUN_NAME}-{stamp}")
    return Path(broadcast_string(path))


def read_splits(config: Config) -> DataSplits[IndexedDataset]:
    """The config's train, validation and test splits; a loader's complaint becomes a :class:`ConfigError`."""
    # Random-weight HF models (hf_config) borrow MiniLM's tokenizer: their vocab_size must cover it.
    tokenizer = None if config.model.kind == "vit" else load_tokenizer(config.model.path or minilm_path())
    try:
        return datasets_from_config(config.data, tokenizer, image_shape=vit_image_shape(config.model.vit))
    except ValueError as error:  # the loaders' messages name the setting
        raise ConfigError(f"data: {error}") from None


def load_splits(config: Config, env: DistEnv) -> DataSplits[IndexedDataset]:
    """Train, validation and test. The validation split serves every evaluation during training; the test split
    is evaluated once, at the end: nothing during training (steps, freeze decisions, evaluations) reads it."""
    splits = read_splits(config)
    for warning in small_split_warnings(splits) if env.is_main else []:
        logger.warning(warning)
    return splits


def build_blocks(config: Config, outputs: int, device: torch.device) -> BlockSequence:
    """The config's model as a block sequence whose head has ``outputs`` outputs, in train mode on ``device``."""
    m = config.model
    try:
        model = build_model(m.kind, num_labels=outputs, path=m.path, hf_config=m.hf_config, pooling=m.pooling,
                            vit=dict(m.vit) if m.kind == "vit" else None,
                            attn_implementation=m.attn_implementation).to(device)
    except (ValueError, TypeError) as error:  # the adapters' messages name the setting
        raise ConfigError(f"model: {error}") from None
    model.train()
    model.compute_dtype = COMPUTE_DTYPES[config.train.precision]
    return model


def example_inputs(dataset: IndexedDataset, max_length: int, device: torch.device, rows: int) -> Activation:
    """The first ``rows`` samples as model inputs on ``device``, text padded to ``max_length``: the shapes a
    profile or a cache record must hold."""
    pad = max_length if dataset.task == TextDataset.task else None
    batch = dataset.get_batch(list(range(min(rows, len(dataset)))), pad_to=pad)
    return tuple(t.to(device) for t in batch.inputs)
