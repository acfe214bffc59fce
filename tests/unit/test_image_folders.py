"""Image files in class folders: the stated conversion rule (mode and size from the model), class names from the
folders, the optional train/ and test/ split, and errors that name the file or folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipetransformer.data import load_image_folder
from pipetransformer.data.image_folders import read_class_folders

SIDE = 8


def write_image(path: Path, value: int, size: tuple[int, int] = (SIDE, SIDE), mode: str = "RGB") -> None:
    """A flat image of ``value`` in every channel (a gradient would make the resize rule harder to check)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], len(mode))
    Image.fromarray(np.full(shape, value, dtype=np.uint8)).save(path)  # the mode follows from the shape


def test_class_folders_are_the_classes_in_sorted_order_and_pixels_follow_the_model(tmp_path: Path) -> None:
    write_image(tmp_path / "dogs" / "a.png", 200, size=(16, 12), mode="RGBA")  # resized, alpha dropped
    write_image(tmp_path / "cats" / "b.JPG", 100)
    write_image(tmp_path / "cats" / "c.bmp", 0, mode="L")
    (tmp_path / "cats" / "notes.txt").write_text("not an image")
    pixels, labels, names = read_class_folders(tmp_path, None, (1, SIDE, SIDE))
    assert names == ("cats", "dogs")
    assert labels.tolist() == [0, 0, 1]
    assert pixels.shape == (3, 1, SIDE, SIDE) and pixels.dtype == torch.float32
    assert pixels[1].unique().tolist() == [0.0] and pixels[2].unique().tolist() == [pytest.approx(200 / 255)]
    rgb, _, _ = read_class_folders(tmp_path, None, (3, 4, 4))
    assert rgb.shape == (3, 3, 4, 4)
    native, _, _ = read_class_folders(tmp_path, None, None)  # no model: RGB at the first image's size
    assert native.shape == (3, 3, SIDE, SIDE)


def test_train_and_test_subfolders_give_the_test_split(tmp_path: Path) -> None:
    for index in range(10):
        write_image(tmp_path / "train" / ("1" if index % 2 else "5") / f"{index}.png", 10 * index)
    write_image(tmp_path / "test" / "5" / "t.png", 30)
    train, validation, test = load_image_folder(tmp_path, validation_fraction=0.2, image_shape=(3, SIDE, SIDE))
    assert train.class_names == test.class_names == ("1", "5")  # names, not ids: "1" and "5" make two classes
    assert (len(train), len(validation), len(test)) == (8, 2, 1)
    assert test.labels.tolist() == [1]


def test_class_folder_mistakes_name_the_folder(tmp_path: Path) -> None:
    write_image(tmp_path / "train" / "cats" / "a.png", 1)
    write_image(tmp_path / "train" / "dogs" / "b.png", 2)
    write_image(tmp_path / "test" / "birds" / "c.png", 3)
    with pytest.raises(ValueError, match="class folder 'birds' is not among the training classes"):
        load_image_folder(tmp_path, image_shape=(3, SIDE, SIDE))
    (tmp_path / "test" / "birds" / "c.png").unlink()
    (tmp_path / "train" / "dogs" / "b.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"b\.png: cannot read it as an image"):
        load_image_folder(tmp_path, image_shape=(3, SIDE, SIDE))
    with pytest.raises(ValueError, match="model.vit.in_channels to 1 or 3"):
        load_image_folder(tmp_path, image_shape=(2, SIDE, SIDE))


def test_data_and_model_are_checked_together(tmp_path: Path) -> None:
    """One class folder cannot train a classifier; images of another shape than the ViT's name the keys to set."""
    from pipetransformer.config import ConfigError, load_config
    from pipetransformer.train.build import build_blocks, check_data_fits_model, read_splits

    root = Path(__file__).resolve().parents[2]
    for index in range(4):
        write_image(tmp_path / "only" / f"{index}.png", 40 * index)
    config = load_config(root / "configs" / "tiny_vit.yaml", ["data.name=image_folder", f"data.path={tmp_path}"])
    train = read_splits(config).train
    model = build_blocks(config, train.num_classes, torch.device("cpu"))
    with pytest.raises(ConfigError, match="has 1 class \\(only\\); a classifier needs at least 2"):
        check_data_fits_model(config, model, train)
    digits = load_config(root / "configs" / "tiny_vit.yaml", ["model.vit.in_channels=3"])
    train = read_splits(digits).train
    with pytest.raises(ConfigError, match="images are 1x8x8 .* model takes 3x8x8: set model.vit.in_channels: 1"):
        check_data_fits_model(digits, build_blocks(digits, train.num_classes, torch.device("cpu")), train)
