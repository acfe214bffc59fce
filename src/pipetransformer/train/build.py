"""What a run is made of, from its config: seeds, the run directory, the data splits, the block model."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pipetransformer.config import LANGUAGE_MODEL_KINDS, Config, ConfigError, RunConfig
from pipetransformer.data import datasets_from_config, small_split_warnings
from pipetransformer.data.batch import DataSplits, IndexedDataset, SampleLimits
from pipetransformer.data.corpus import BYTES, Vocabulary, load_corpus, tokenizer_vocabulary
from pipetransformer.data.images import ImageDataset
from pipetransformer.data.text import TextDataset
from pipetransformer.distributed import DistEnv, broadcast_string
from pipetransformer.models import BlockSequence, build_model, load_tokenizer, minilm_path
from pipetransformer.models.blocks import Activation
from pipetransformer.models.hf_decoder import load_decoder_tokenizer, token_rows
from pipetransformer.models.vit import PatchEmbeddings, vit_image_shape

__all__ = ["build_blocks", "check_data_fits_model", "describe_model", "example_inputs", "language_model_vocabulary",
           "load_splits", "model_image_shape", "resolve_run_dir", "seed_everything"]

logger = logging.getLogger(__name__)

COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
"""``train.precision`` -> the autocast dtype of every forward (None: the weights' own fp32)."""
MIN_CLASSES = 2
"""A classifier needs two classes to tell apart."""


def seed_everything(config: Config) -> None:
    torch.manual_seed(config.seed)
    if config.deterministic:
        torch.use_deterministic_algorithms(True)


def resolve_run_dir(settings: RunConfig) -> Path:
    """``run.dir``, or ``runs/<name>-<time>`` as rank 0 names it. Not created here: the run's recorder creates it
    once set-up has succeeded, so a run refused while setting up (its data, model or memory budget) leaves none."""
    return Path(broadcast_string(settings.resolved_dir()))


def read_splits(config: Config) -> DataSplits[IndexedDataset]:
    """The config's train, validation and test splits; a loader's complaint becomes a :class:`ConfigError`."""
    data, kind = config.data, config.model.kind
    # Random-weight HF models (hf_config) borrow MiniLM's tokenizer: their vocab_size must cover it. The built-in
    # decoder reads bytes (data.corpus), so it loads none.
    vocabulary = language_model_vocabulary(config) if kind in LANGUAGE_MODEL_KINDS else None
    try:
        if vocabulary is not None:
            return load_corpus(data.name, max_length=data.max_length, path=data.path, text_column=data.text_column,
                               response_column=data.response_column, encoding=data.encoding,
                               validation_fraction=data.validation_fraction, test_fraction=data.test_fraction,
                               seed=data.split_seed, limits=SampleLimits(data.max_train_samples, data.max_eval_samples,
                                                                         data.max_test_samples),
                               vocabulary=vocabulary)
        tokenizer = None if kind == "vit" else load_tokenizer(config.model.path or minilm_path())
        return datasets_from_config(data, tokenizer, image_shape=vit_image_shape(config.model.vit))
    except ValueError as error:  # the loaders' messages name the setting
        raise ConfigError(f"data: {error}") from None


def language_model_vocabulary(config: Config) -> Vocabulary:
    """How a language model's text becomes tokens: bytes for the built-in decoder, the tokenizer saved with a Hugging
    Face decoder (``model.path``) for it. A model the blocks cannot split, or a tokenizer that does not fit it, is a
    :class:`ConfigError` naming the model."""
    path = config.model.path
    if config.model.kind != "hf_decoder" or path is None:
        return BYTES
    try:
        rows = token_rows(path)  # refuses what the blocks cannot split before the tokenizer loads
        return tokenizer_vocabulary(load_decoder_tokenizer(path), rows, path)
    except ValueError as error:
        raise ConfigError(f"model: {error}") from None


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
                            decoder=({"max_positions": config.data.max_length, **m.decoder} if m.kind == "decoder"
                                     else None),
                            attn_implementation=m.attn_implementation).to(device)
    except (ValueError, TypeError) as error:  # the adapters' messages name the setting
        raise ConfigError(f"model: {error}") from None
    model.train()
    model.compute_dtype = COMPUTE_DTYPES[config.train.precision]
    return model


def _image_remedy(config: Config, shape: tuple[int, int, int]) -> str:
    """What to set so the model takes images of ``shape`` (it takes square ones only)."""
    channels, height, width = shape
    if height != width:
        return f"the model takes square images: resize them to {height}x{height}"
    if config.model.kind == "vit":
        return (f"set model.vit.in_channels: {channels} and model.vit.image_size: {height} (model.vit.patch_size must "
                "divide it), or give images of the model's shape")
    return (f"set num_channels: {channels} and image_size: {height} in model.hf_config (or the config of model.path), "
            "or give images of the model's shape")


def model_image_shape(model: BlockSequence) -> tuple[int, int, int] | None:
    """``(channels, height, width)`` the model's embeddings take: the built-in ViT's or a Hugging Face config's."""
    embeddings = model.blocks[0]
    if isinstance(embeddings, PatchEmbeddings):
        return embeddings.in_channels, embeddings.image_size, embeddings.image_size
    hf = _hf_config(model)
    size, channels = getattr(hf, "image_size", None), getattr(hf, "num_channels", None)
    if isinstance(size, int) and isinstance(channels, int):
        return channels, size, size
    return None


def _hf_config(model: BlockSequence) -> object | None:
    """The Hugging Face config a block keeps (its ``model_type`` tells it from other ``config`` attributes)."""
    return next((m.config for m in model.modules() if hasattr(getattr(m, "config", None), "model_type")), None)


def _positions_fit(model: BlockSequence, length: int, device: torch.device) -> bool:
    """Whether the embeddings take ``length`` tokens: tried on one all-padding row, which reads every position
    (a rule from the config alone would miss RoBERTa's offset positions and relative or rotary ones)."""
    ids = torch.zeros(1, length, dtype=torch.int64, device=device)
    try:
        with torch.no_grad():
            model.blocks[0](ids, torch.ones_like(ids))
    except (IndexError, RuntimeError, ValueError):
        return False
    return True


def check_data_fits_model(config: Config, model: BlockSequence, train: IndexedDataset) -> None:
    """Refuse data the model cannot take, in one line naming the settings to change, before any step (and before
    workers start: the launcher's pre-flight calls it): image channels and size against the model's embeddings,
    ``data.max_length`` against its positions, and at least two classes for its head (which is built with the
    data's class count, so the head itself always fits)."""
    if isinstance(train, ImageDataset):
        expected = model_image_shape(model)
        if expected is not None and train.image_shape != expected:
            shown = "x".join(map(str, train.image_shape))
            raise ConfigError(f"data: the images are {shown} (channels x height x width) but the model takes "
                              f"{'x'.join(map(str, expected))}: {_image_remedy(config, train.image_shape)}")
    elif isinstance(train, TextDataset):
        device = next(model.parameters()).device
        if not _positions_fit(model, config.data.max_length, device):
            positions = getattr(_hf_config(model), "max_position_embeddings", "fewer")
            raise ConfigError(f"data.max_length={config.data.max_length} is longer than the model's {positions} "
                              "position embeddings (max_position_embeddings): lower data.max_length")
    if train.num_classes < MIN_CLASSES:
        raise ConfigError(f"data: the training data has {train.num_classes} class ({', '.join(train.class_names)}); "
                          f"a classifier needs at least {MIN_CLASSES}: check data.label_column or the class folders")


def describe_model(config: Config, model: BlockSequence) -> str:
    """What was built, and from which weights: ``model.kind``, blocks, parameters, and the weights' source."""
    m = config.model
    source = {"minilm": "the packaged all-MiniLM-L6-v2", "hf": m.path or "random init (model.hf_config)",
              "vit": m.path or "random init", "decoder": m.path or "random init", "hf_decoder": m.path}[m.kind]
    parameters = sum(p.numel() for p in model.parameters())
    return f"{m.kind}, {len(model)} blocks, {parameters / 1e6:.2f}M parameters, weights: {source}"


def example_inputs(dataset: IndexedDataset, max_length: int, device: torch.device, rows: int) -> Activation:
    """The first ``rows`` samples as model inputs on ``device``, text padded to ``max_length``: the shapes a
    profile or a cache record must hold."""
    pad = max_length if dataset.task == TextDataset.task else None
    batch = dataset.get_batch(list(range(min(rows, len(dataset)))), pad_to=pad)
    return tuple(t.to(device) for t in batch.inputs)
