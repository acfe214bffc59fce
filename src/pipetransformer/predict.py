"""``pipetransformer predict RUN_DIR --input FILE``: a trained run's model on new texts (a CSV) or images (a folder);
a language model's run continues the CSV's prompts.

Everything comes from the run directory: its ``config.yaml`` rebuilds the model, ``model.safetensors`` (or
``best-validation.safetensors``) fills it, ``summary.json`` names the classes in the head's order and, for images,
the normalization the training pixels had. Inputs go through the training data's own rules (the tokenizer and
``data.max_length``; for images the class-folder conversion of :mod:`pipetransformer.data.image_folders`), so
the test split's files give the run's test predictions exactly.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipetransformer.config import LANGUAGE_MODEL_KINDS, Config, ConfigError, load_config
from pipetransformer.models.blocks import BlockSequence

__all__ = ["RunModel", "WEIGHTS", "continue_prompts", "load_run_model", "predict_command", "predict_inputs",
           "read_run"]

WEIGHTS = {"final": "model.safetensors", "best": "best-validation.safetensors"}
"""``--weights``: the run's final weights, or those of its best validation (kept with checkpoints on)."""
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
DEFAULT_OUTPUT = "predictions.csv"
PREDICT_BATCH = 64
UINT8_MAX = 255


@dataclass
class RunModel:
    config: Config
    model: BlockSequence  # in eval mode, on the CPU
    class_names: list[str]
    summary: dict[str, Any]


def read_run(run_dir: Path, weights: str) -> tuple[Config, dict[str, Any], Path]:
    """A run's config, summary and weights file; a directory that is not a finished or interrupted run, or lacks the
    weights asked for, is a one-line :class:`ConfigError`."""
    missing = [name for name in (CONFIG_FILE, SUMMARY_FILE, WEIGHTS[weights]) if not (run_dir / name).is_file()]
    if missing:
        hint = ("train with checkpoints on (checkpoint.enabled) to keep them, or use --weights final"
                if missing == [WEIGHTS["best"]] else "point it at a run directory that training wrote to the end")
        raise ConfigError(f"{run_dir} has no {', '.join(missing)}: {hint}")
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    if "class_names" not in summary:
        raise ConfigError(f"{run_dir}/{SUMMARY_FILE} names no classes (a run of an older version): train it again")
    return load_config(run_dir / CONFIG_FILE), summary, run_dir / WEIGHTS[weights]


def load_run_model(run_dir: Path, weights: str = "final") -> RunModel:
    """The model a run trained (``weights``: final or best), with its class names."""
    from safetensors.torch import load_file

    from pipetransformer.train.build import build_blocks, language_model_vocabulary

    config, summary, path = read_run(run_dir, weights)
    language_model = config.model.kind in LANGUAGE_MODEL_KINDS
    outputs = language_model_vocabulary(config).size if language_model else len(summary["class_names"])
    model = build_blocks(config, outputs, torch.device("cpu"))
    with torch.no_grad():
        model.load_state_dict(load_file(str(path)))
    return RunModel(config, model.eval(), list(summary["class_names"]), summary)


def _text_inputs(run: RunModel, path: Path) -> tuple[list[str], list[tuple[torch.Tensor, ...]]]:
    """Row names (``line N``) and model inputs of a CSV's ``data.text_column``, tokenized as in training."""
    from pipetransformer.data.text import TextDataset, read_csv
    from pipetransformer.models import load_tokenizer, minilm_path

    data = run.config.data
    rows = read_csv(path, (data.text_column,), f"set data.text_column in {CONFIG_FILE} or name the column "
                                                f"{data.text_column!r}", data.encoding)
    tokenizer = load_tokenizer(run.config.model.path or minilm_path())
    texts = [row[data.text_column] for _, row in rows]
    dataset = TextDataset.from_texts(texts, [0] * len(texts), run.class_names, tokenizer, data.max_length)
    batches = [tuple(dataset.get_batch(list(range(start, min(start + PREDICT_BATCH, len(texts))))).inputs)
               for start in range(0, len(texts), PREDICT_BATCH)]
    return [f"line {line}" for line, _ in rows], batches


def _image_inputs(run: RunModel, folder: Path) -> tuple[list[str], list[tuple[torch.Tensor, ...]]]:
    """Every image file under ``folder`` (sorted paths, relative to it), converted and normalized as in training."""
    from pipetransformer.data.image_folders import IMAGE_EXTENSIONS, image_mode, read_image
    from pipetransformer.train.build import model_image_shape

    shape = model_image_shape(run.model)
    normalization = run.summary.get("image_normalization")
    if shape is None or normalization is None:
        raise ConfigError(f"the run's model takes no images of a known shape: predict {folder} with an image model")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        raise ConfigError(f"{folder} holds no images ({', '.join(IMAGE_EXTENSIONS)}): pass a folder of images")
    mean = torch.tensor(normalization["mean"], dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(normalization["std"], dtype=torch.float32).view(1, -1, 1, 1)
    batches = []
    for start in range(0, len(files), PREDICT_BATCH):
        try:
            images = [read_image(p, image_mode(shape[0]), (shape[2], shape[1]))
                      for p in files[start:start + PREDICT_BATCH]]
        except ValueError as error:
            raise ConfigError(str(error)) from None
        pixels = torch.from_numpy(np.stack(images)).float().div_(UINT8_MAX)
        batches.append((pixels.sub_(mean).div_(std),))
    return [str(p.relative_to(folder)) for p in files], batches


def predict_inputs(run: RunModel, source: Path) -> tuple[list[str], torch.Tensor]:
    """Names of the inputs (CSV lines or image paths) and their class probabilities ``[N, classes]``."""
    if run.model.task == "image":
        if not source.is_dir():
            raise ConfigError(f"--input {source}: an image model predicts a folder of images")
        names, batches = _image_inputs(run, source)
    else:
        if not source.is_file():
            raise ConfigError(f"--input {source}: a text model predicts a CSV file with a "
                              f"{run.config.data.text_column!r} column")
        try:
            names, batches = _text_inputs(run, source)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    with torch.no_grad():
        probabilities = [torch.softmax(run.model(*inputs).float(), dim=-1) for inputs in batches]
    return names, torch.cat(probabilities)


def continue_prompts(run: RunModel, prompts: list[str], max_new_tokens: int) -> list[str]:
    """A language model's greedy continuation of each prompt (its tokens, as in training): the likeliest next token,
    appended until the end-of-text token, ``max_new_tokens`` tokens, or the model's last position. The whole window
    (``data.max_length`` tokens at most) runs again for every token (no key-value cache): windows here are short."""
    from pipetransformer.train.build import language_model_vocabulary

    vocabulary = language_model_vocabulary(run.config)
    end, positions = vocabulary.end_of_text, run.config.data.max_length
    continuations = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = vocabulary.encode(prompt)[-positions + 1:] or [end]
            new: list[int] = []
            while len(new) < max_new_tokens:
                window = torch.tensor([(tokens + new)[-positions:]], dtype=torch.int64)
                token = int(run.model(window, torch.ones_like(window))[0, -1].argmax())
                if token == end:
                    break
                new.append(token)
            continuations.append(vocabulary.decode(new))
    return continuations


def _generate_command(run: RunModel, source: Path, output: Path, max_new_tokens: int) -> int:
    from pipetransformer.data.text import read_csv

    column = run.config.data.text_column
    if not source.is_file():
        raise ConfigError(f"--input {source}: a language model continues the prompts of a CSV's {column!r} column")
    try:
        rows = read_csv(source, (column,), f"name the prompts' column {column!r} (data.text_column)",
                        run.config.data.encoding)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    prompts = [row[column] for _, row in rows]
    continuations = continue_prompts(run, prompts, max_new_tokens)
    with output.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["input", "prompt", "continuation"])
        for (line, _), prompt, continuation in zip(rows, prompts, continuations, strict=True):
            writer.writerow([f"line {line}", prompt, continuation])
    print(f"{len(prompts)} continuations (greedy, at most {max_new_tokens} tokens) written to {output}")
    return 0


def predict_command(run_dir: Path, source: Path, output: Path | None, weights: str, max_new_tokens: int) -> int:
    """Write one CSV row per input: its name, the predicted class name and probability, every class's probability;
    for a language model (``model.kind: decoder`` or ``hf_decoder``), the prompt and its continuation."""
    run = load_run_model(run_dir, weights)
    if run.config.model.kind in LANGUAGE_MODEL_KINDS:
        return _generate_command(run, source, output or run_dir / DEFAULT_OUTPUT, max_new_tokens)
    names, probabilities = predict_inputs(run, source)
    output = output or run_dir / DEFAULT_OUTPUT
    best, index = probabilities.max(dim=-1)
    with output.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["input", "label", "probability", *(f"p({name})" for name in run.class_names)])
        for row, name in enumerate(names):
            writer.writerow([name, run.class_names[int(index[row])], f"{float(best[row]):.6f}",
                             *(f"{float(p):.6f}" for p in probabilities[row])])
    print(f"{len(names)} predictions ({weights} weights) written to {output}")
    return 0
