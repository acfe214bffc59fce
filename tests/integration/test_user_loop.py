"""The user's loop on 2 real gloo workers: their own images in class folders -> train -> use the model."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from jobs import JOB_TIMEOUT_S, ROOT, run_job, summary

pytestmark = pytest.mark.slow

VIT = "tiny_vit.yaml"  # 8x8 greyscale ViT
PNG_SIDE = 10  # RGB files of another size than the model's: converted and resized by the stated rule
IMAGES_PER_CLASS = {"circle": 24, "square": 24}
TEST_PER_CLASS = 6


def _write_pngs(folder: Path, count: int, kind: str, seed: int) -> None:
    """Tiny RGB PNGs a ViT can tell apart: a bright disc or a bright square on noise."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    y, x = np.mgrid[:PNG_SIDE, :PNG_SIDE]
    centre = (PNG_SIDE - 1) / 2
    shape = ((y - centre) ** 2 + (x - centre) ** 2 <= (PNG_SIDE / 3) ** 2 if kind == "circle"
             else (abs(y - centre) <= PNG_SIDE / 3) & (abs(x - centre) <= PNG_SIDE / 3))
    for index in range(count):
        pixels = rng.integers(0, 80, size=(PNG_SIDE, PNG_SIDE, 3))
        pixels[shape] += 150
        Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{kind}-{index}.png")


@pytest.fixture(scope="module")
def png_folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``train/<class>/*.png`` and ``test/<class>/*.png``, as users keep their images."""
    root = tmp_path_factory.mktemp("pngs")
    for seed, (kind, count) in enumerate(IMAGES_PER_CLASS.items()):
        _write_pngs(root / "train" / kind, count, kind, seed)
        _write_pngs(root / "test" / kind, TEST_PER_CLASS, kind, seed + len(IMAGES_PER_CLASS))
    return root


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "pipetransformer.cli", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=JOB_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _predictions(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_png_class_folders_train_on_two_workers_and_predict_reproduces_the_test_accuracy(
        tmp_path: Path, png_folders: Path) -> None:
    """Train on train/<class>/*.png, then ``predict`` on the test folder: the same prediction for every test image as
    the run's own test evaluation, so the same accuracy."""
    run_dir, temporary = tmp_path / "run", tmp_path / "tmp"
    temporary.mkdir()
    run_job(VIT, run_dir, "data.name=image_folder", f"data.path={png_folders}", "data.max_train_samples=null",
            "data.max_eval_samples=null", "data.max_test_samples=null", "train.epochs=3", "train.batch_size=8",
            nproc=2, env={"TMPDIR": str(temporary)})
    assert not list(temporary.glob("torchelastic_*")), "the launch left torchrun's log folders behind"
    result = summary(run_dir)
    assert result["steps"] == 3 * 6  # 48 training images less a validation tenth (4): 44 per epoch, 6 batches
    assert result["class_names"] == sorted(IMAGES_PER_CLASS)
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "best-validation.safetensors").is_file()

    output = tmp_path / "predictions.csv"
    _cli("predict", str(run_dir), "--input", str(png_folders / "test"), "--output", str(output))
    rows = _predictions(output)
    assert [row["input"] for row in rows] == sorted(row["input"] for row in rows)  # class folders, then file names
    correct = [float(row["label"] == Path(row["input"]).parent.name) for row in rows]
    assert correct == json.loads((run_dir / "test_samples.json").read_text())["final"]
    assert float(torch.tensor(correct).mean()) == result["test_accuracy"]


TEXT = "tiny_text.yaml"  # a random-weight BERT


def test_export_loads_in_transformers_and_gives_the_run_models_logits(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "exported"
    run_job(TEXT, run_dir, "train.max_steps=4", nproc=2)
    _cli("export", str(run_dir), str(out))
    from transformers import AutoModel

    from pipetransformer.export import load_exported
    from pipetransformer.predict import load_run_model

    encoder = AutoModel.from_pretrained(out, local_files_only=True)
    assert encoder.config.id2label == {0: "rotten", 1: "fresh"}
    exported, tokenizer = load_exported(out)
    texts = ["a moving, funny and wise film", "two hours I will never get back", "fine"]
    batch = tokenizer(texts, padding=True, return_tensors="pt", return_token_type_ids=False)
    run = load_run_model(run_dir)
    with torch.no_grad():
        expected = run.model(batch["input_ids"], batch["attention_mask"])
        assert torch.allclose(exported(batch["input_ids"], batch["attention_mask"]), expected, atol=1e-5)
        hidden = encoder(**batch).last_hidden_state  # transformers alone, the head applied by hand
        assert torch.allclose(exported.head(hidden, batch["attention_mask"])[0], expected, atol=1e-5)

    table = tmp_path / "texts.csv"
    with table.open("w", newline="") as handle:
        csv.writer(handle).writerows([["text"], *([text] for text in texts)])
    _cli("predict", str(run_dir), "--input", str(table), "--output", str(tmp_path / "p.csv"))
    rows = _predictions(tmp_path / "p.csv")
    assert [row["input"] for row in rows] == ["line 2", "line 3", "line 4"]
    probabilities = torch.softmax(expected, dim=-1)
    for row, p in zip(rows, probabilities, strict=True):
        assert row["label"] == run.class_names[int(p.argmax())]
        assert float(row["p(fresh)"]) == pytest.approx(float(p[1]), abs=1e-5)
