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


def test_png_class_folders_train_on_two_workers_predict_reproduces_the_test_accuracy_and_export_loads_in_transformers(
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
    _check_image_export(run_dir, tmp_path / "exported", png_folders / "test", rows)


def _check_image_export(run_dir: Path, out: Path, images: Path, rows: list[dict[str, str]]) -> None:
    """``export`` writes a standard ``ViTForImageClassification`` and its image processor: transformers' own
    ``AutoModelForImageClassification`` and ``pipeline`` give ``predict``'s probabilities for every test image (the
    grey model takes RGB, its patch projection weighted as Pillow's grey conversion)."""
    from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline

    _cli("export", str(run_dir), str(out))
    assert not list(out.glob("*.py")), "a standard class: no model code shipped"
    assert not list(out.glob("*.bin")) and (out / "model.safetensors").is_file()
    model = AutoModelForImageClassification.from_pretrained(out).eval()
    processor = AutoImageProcessor.from_pretrained(out)
    assert model.config.id2label == {0: "circle", 1: "square"}
    classify = pipeline("image-classification", model=str(out), top_k=None)
    for row in rows:  # the grey image predict reads; the pipeline hands it over as RGB (R = G = B), as does .convert
        image = Image.open(images / row["input"]).convert("L")
        with torch.no_grad():
            inputs = processor(image.convert("RGB"), return_tensors="pt")
            probabilities = torch.softmax(model(**inputs).logits, dim=-1)[0]
        scores = {entry["label"]: entry["score"] for entry in classify(image)}
        for index, name in model.config.id2label.items():
            assert float(probabilities[index]) == pytest.approx(float(row[f"p({name})"]), abs=1e-5)
            assert scores[name] == pytest.approx(float(row[f"p({name})"]), abs=1e-5)
    card = (out / "README.md").read_text()
    assert "image classifier" in card and "test accuracy" in card and "pipetransformer train training_config.yaml" \
        in card


TEXT = "tiny_text.yaml"  # a random-weight BERT
TEXTS = ["a moving, funny and wise film", "two hours I will never get back", "fine"]


def test_export_loads_in_transformers_with_the_trained_head_and_gives_predicts_probabilities(tmp_path: Path) -> None:
    """The trained head pools over tokens, which no standard class does: the export ships its model code, transformers
    refuses it without ``trust_remote_code`` (instead of a standard class with a new, random head), and with it
    ``AutoModelForSequenceClassification`` and ``pipeline`` give ``predict``'s probabilities."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    run_dir, out = tmp_path / "run", tmp_path / "exported"
    run_job(TEXT, run_dir, "train.max_steps=4", "freeze.enabled=true", "freeze.policy=schedule",
            "freeze.interval_unit=steps", "freeze.schedule=[[2,1]]", nproc=2)
    _cli("export", str(run_dir), str(out))
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    table = tmp_path / "texts.csv"
    with table.open("w", newline="") as handle:
        csv.writer(handle).writerows([["text"], *([text] for text in TEXTS)])
    _cli("predict", str(run_dir), "--input", str(table), "--output", str(tmp_path / "p.csv"))
    rows = _predictions(tmp_path / "p.csv")
    assert [row["input"] for row in rows] == ["line 2", "line 3", "line 4"]

    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True).eval()
    assert model.config.id2label == {0: "rotten", 1: "fresh"}
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        probabilities = torch.softmax(model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits, dim=-1)
    classify = pipeline("text-classification", model=str(out), trust_remote_code=True, top_k=None)
    for row, p, scores in zip(rows, probabilities, classify(TEXTS), strict=True):
        by_label = {entry["label"]: entry["score"] for entry in scores}
        for index, name in model.config.id2label.items():
            assert float(p[index]) == pytest.approx(float(row[f"p({name})"]), abs=1e-5)
            assert by_label[name] == pytest.approx(float(row[f"p({name})"]), abs=1e-5)
    card = (out / "README.md").read_text()
    assert "text classifier" in card and "the bottom 1 layer frozen at step 2" in card
    assert (out / "training_config.yaml").is_file()
