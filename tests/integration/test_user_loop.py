"""The user's loop on 2 real gloo workers: their own images in class folders -> train -> use the model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jobs import run_job, summary

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


def test_a_folder_of_png_class_folders_trains_on_two_workers(tmp_path: Path, png_folders: Path) -> None:
    run_dir = tmp_path / "run"
    run_job(VIT, run_dir, "data.name=image_folder", f"data.path={png_folders}", "data.max_train_samples=null",
            "data.max_eval_samples=null", "data.max_test_samples=null", "train.epochs=3", "train.batch_size=8",
            nproc=2)
    result = summary(run_dir)
    assert result["steps"] == 3 * 6  # 48 training images less a validation tenth (4): 44 per epoch, 6 batches
    assert result["test_accuracy"] is not None
