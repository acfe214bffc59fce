"""Images in class folders, as users keep them: ``root/<class>/*.png`` (torchvision's ImageFolder layout), or
``root/train/<class>/...`` with an optional ``root/test/<class>/...``.

The rule that turns files into the model's input, stated once: each file is decoded with Pillow, converted to
greyscale (``L``) for a one-channel model or to ``RGB`` for a three-channel one (an alpha channel is dropped),
and resized to the model's square ``image_size`` with bilinear filtering when its size differs (a non-square
image is stretched: crop it beforehand where the aspect matters). Pixels are scaled to [0, 1] and then normalized
like every image data set here. Images are decoded once, at load time: every epoch (and the activation cache)
sees the same pixels, so there is no random augmentation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

__all__ = ["IMAGE_EXTENSIONS", "class_folder_root", "image_mode", "read_class_folders", "read_image"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
"""Files read as images (any case); other files in a class folder are skipped."""
MODES = {1: "L", 3: "RGB"}
"""Pillow mode per model channel count."""
DEFAULT_CHANNELS = 3
"""Without a model to read the channels from (the Python API), images are read as RGB."""
UINT8_MAX = 255


def image_mode(channels: int) -> str:
    if channels not in MODES:
        raise ValueError(f"image folders are read as greyscale or RGB: set model.vit.in_channels to 1 or 3, "
                         f"not {channels}")
    return MODES[channels]


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def _class_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def class_folder_root(folder: Path) -> Path | None:
    """The folder whose subfolders are the training classes (``folder/train`` or ``folder`` itself), or None
    when ``folder`` is not laid out in class folders."""
    train = folder / "train"
    root = train if train.is_dir() else folder
    classes = _class_dirs(root)
    return root if classes and any(_image_files(c) for c in classes) else None


def read_image(path: Path, mode: str, size: tuple[int, int] | None) -> np.ndarray:
    """One file as uint8 ``[C, H, W]`` in ``mode``, resized to ``size`` (width, height) where it differs."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            converted = image.convert(mode)
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"{path}: cannot read it as an image ({error.__class__.__name__}); remove or replace "
                         "the file") from None
    if size is not None and converted.size != size:
        converted = converted.resize(size, Image.Resampling.BILINEAR)
    array = np.asarray(converted, dtype=np.uint8)
    return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)


def read_class_folders(root: Path, class_names: Sequence[str] | None,
                       image_shape: tuple[int, int, int] | None) -> tuple[torch.Tensor, torch.Tensor, tuple[str, ...]]:
    """``(pixels [N, C, H, W] in [0, 1], labels, class names)`` of ``root/<class>/*``. ``class_names``: the training
    split's, which a test split's folders must be among (None: this is the training split, its folders the classes).
    ``image_shape``: the model's ``(channels, size, size)``; None reads RGB at the first image's size."""
    folders = _class_dirs(root)
    names = tuple(p.name for p in folders) if class_names is None else tuple(class_names)
    unknown = [p.name for p in folders if p.name not in names]
    if unknown:
        raise ValueError(f"{root}: class folder {unknown[0]!r} is not among the training classes "
                         f"({', '.join(names)}); rename it or add it to the training folders")
    channels = image_shape[0] if image_shape is not None else DEFAULT_CHANNELS
    mode = image_mode(channels)
    size = (image_shape[2], image_shape[1]) if image_shape is not None else None
    images: list[np.ndarray] = []
    labels: list[int] = []
    for folder in folders:
        files = _image_files(folder)
        if not files:
            raise ValueError(f"{folder}: the class folder holds no images ({', '.join(IMAGE_EXTENSIONS)}); add some "
                             "or remove the folder")
        for path in files:
            image = read_image(path, mode, size)
            size = size or (image.shape[2], image.shape[1])
            images.append(image)
            labels.append(names.index(folder.name))
    pixels = torch.from_numpy(np.stack(images)).float().div_(UINT8_MAX)
    return pixels, torch.tensor(labels, dtype=torch.int64), names
