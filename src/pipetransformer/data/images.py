"""Image classification data held as one normalized float32 tensor ``[N, C, H, W]``.

One tensor means a batch is a single index op. Pixels are normalized per channel with the
*training* split's mean and std, and the same statistics are applied to the validation and test splits.
"""

from __future__ import annotations

import gzip
import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pipetransformer.data.batch import DataSplits, DatasetUnavailableError, IndexedDataset, held_out_splits
from pipetransformer.data.image_folders import IMAGE_EXTENSIONS, class_folder_root, read_class_folders

__all__ = [
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_ROOT",
    "ImageDataset",
    "load_digits_images",
    "load_fashion_mnist",
    "load_image_folder",
    "read_idx",
]

FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
FASHION_MNIST_INSTALL_HINT = (
    "run `bash scripts/setup.sh` or `apt-get update && apt-get install -y dataset-fashion-mnist`"
)
DEFAULT_VALIDATION_FRACTION = 0.1
DEFAULT_TEST_FRACTION = 0.1

UINT8_MAX = 255
DIGITS_MAX_VALUE = 16
"""scikit-learn's digits are 4-bit intensities 0..16."""
DIGITS_SIDE = 8
DIGITS_CLASSES = 10
DIGITS_FILE = ("datasets", "data", "digits.csv.gz")
"""Where scikit-learn keeps its digits, under its package directory. Read directly: importing scikit-learn (and
SciPy with it) takes longer than the whole data set (2.6 s against 0.2 s in each process on a 2-core VM)."""
MIN_STD = 1e-6
"""Floor for a channel's std so a constant channel does not divide by zero."""
CHANNEL_COUNTS = (1, 3, 4)
"""Grey, RGB, RGBA: used only to recognise channels-last arrays and ask for [N, C, H, W]."""

Normalization = tuple[list[float], list[float]]
"""Per channel ``(mean, std)``: pixels in [0, 1] become ``(pixels - mean) / std``."""

IDX_PREFIXES = {"train": "train", "test": "t10k"}
IDX_IMAGES = "images-idx3-ubyte"
IDX_LABELS = "labels-idx1-ubyte"
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
IDX_HEADER_BYTES = 4
IDX_DIM_BYTES = 4


class ImageDataset(IndexedDataset):
    """Images as one float32 tensor ``pixels[N, C, H, W]``; items are ``(index, (pixels[C,H,W],), label)``."""

    task = "image"

    def __init__(self, pixels: torch.Tensor, labels: torch.Tensor, class_names: Sequence[str],
                 normalization: Normalization | None = None) -> None:
        """``normalization``: the per-channel ``(mean, std)`` the pixels were given, for new images to get too."""
        if pixels.dim() != 4 or pixels.dtype != torch.float32:
            raise ValueError(f"pixels must be a float32 [N, C, H, W] tensor, got {pixels.dtype} {tuple(pixels.shape)}")
        super().__init__((pixels,), labels, class_names)
        self.pixels = pixels
        self.normalization = normalization

    @property
    def image_shape(self) -> tuple[int, int, int]:
        channels, height, width = self.pixels.shape[1:]
        return channels, height, width

    def _gather_inputs(self, index: torch.Tensor, pad_to: int | None) -> tuple[torch.Tensor, ...]:
        """Images already have one fixed shape, so ``pad_to`` has nothing to do here."""
        return (self.pixels[index],)

    def select(self, positions: torch.Tensor) -> ImageDataset:
        return ImageDataset(self.pixels[positions], self.labels[positions], self.class_names, self.normalization)


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format: magic ``0 0 dtype ndim``, big-endian int32 dims, data), gzipped or not."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(data) < IDX_HEADER_BYTES or data[0] != 0 or data[1] != 0 or data[2] not in IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number); give MNIST-style idx files")
    dtype, ndim = IDX_DTYPES[data[2]], data[3]
    offset = IDX_HEADER_BYTES + IDX_DIM_BYTES * ndim
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=IDX_HEADER_BYTES))
    expected = offset + int(np.prod(dims)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"{path} holds {len(data)} bytes but its header {dims} says {expected}; the file is truncated or corrupt"
        )
    return np.frombuffer(data, dtype=dtype, offset=offset).reshape(dims)


def _as_pixels(images: np.ndarray, source: str) -> torch.Tensor:
    """``[N, H, W]`` or ``[N, C, H, W]`` numbers as float32 ``[N, C, H, W]``; uint8 is scaled to [0, 1]."""
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim != 4:
        raise ValueError(f"{source}: images must be [N, H, W] or [N, C, H, W], got shape {images.shape}")
    elif images.shape[-1] in CHANNEL_COUNTS and images.shape[1] not in CHANNEL_COUNTS:
        raise ValueError(
            f"{source}: shape {images.shape} looks channels-last; save it as [N, C, H, W] (transpose 0, 3, 1, 2)"
        )
    if not np.issubdtype(images.dtype, np.number):
        raise ValueError(f"{source}: images must be numeric, got dtype {images.dtype}")
    pixels = torch.from_numpy(np.array(images, dtype=np.float32))
    if images.dtype == np.uint8:
        pixels.div_(UINT8_MAX)
    return pixels


def _as_labels(labels: np.ndarray, rows: int, source: str) -> torch.Tensor:
    if labels.ndim != 1 or labels.shape[0] != rows or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{source}: labels must be {rows} integers (one per image), got {labels.dtype} {labels.shape}")
    if rows > 0 and labels.min() < 0:
        raise ValueError(f"{source}: labels must be class ids >= 0, found {labels.min()}")
    return torch.from_numpy(np.array(labels, dtype=np.int64))


def _normalized(splits: DataSplits[ImageDataset]) -> DataSplits[ImageDataset]:
    """Apply the training split's per-channel statistics to every split (only on datasets a loader just built)."""
    std, mean = torch.std_mean(splits.train.pixels, dim=(0, 2, 3), keepdim=True)
    std = std.clamp_min(MIN_STD)
    for dataset in splits:
        dataset.pixels.sub_(mean).div_(std)
        dataset.normalization = (mean.flatten().tolist(), std.flatten().tolist())
    return splits


def load_fashion_mnist(
    root: str | Path = FASHION_MNIST_ROOT, validation_fraction: float = DEFAULT_VALIDATION_FRACTION, seed: int = 0
) -> DataSplits[ImageDataset]:
    """Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (``[1, 28, 28]``, 10 classes): validation a ``seed``-ed
    fraction of the 60k training images, test the official 10k."""
    folder = Path(root)
    if _find_idx(folder, "train", IDX_IMAGES) is None:
        raise DatasetUnavailableError(f"Fashion-MNIST not found in {folder}: {FASHION_MNIST_INSTALL_HINT}")
    train = ImageDataset(*_read_idx_split(folder, "train"), FASHION_MNIST_CLASSES)
    test = ImageDataset(*_read_idx_split(folder, "test"), FASHION_MNIST_CLASSES)
    return _normalized(held_out_splits(train, validation_fraction, DEFAULT_TEST_FRACTION, seed, test=test))


def load_digits_images(
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION, test_fraction: float = DEFAULT_TEST_FRACTION,
    seed: int = 0,
) -> DataSplits[ImageDataset]:
    """scikit-learn's 1,797 8x8 digits (shipped with the package, so always offline), in ``seed``-ed splits."""
    table = _digits_table()
    pixels = _as_pixels(table[:, :-1].reshape(-1, DIGITS_SIDE, DIGITS_SIDE) / DIGITS_MAX_VALUE, "scikit-learn digits")
    labels = _as_labels(table[:, -1].astype(np.int64), pixels.shape[0], "scikit-learn digits")
    dataset = ImageDataset(pixels, labels, tuple(str(d) for d in range(DIGITS_CLASSES)))
    return _normalized(held_out_splits(dataset, validation_fraction, test_fraction, seed))


def _digits_table() -> np.ndarray:
    """The digits as scikit-learn stores them, one row per image: 64 pixels, then the label. Read from the file
    itself where the package keeps it (located without importing it); through ``load_digits`` otherwise."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise DatasetUnavailableError("the digits data set needs scikit-learn: run `pip install scikit-learn`")
    if spec.origin is not None and (path := Path(spec.origin).parent.joinpath(*DIGITS_FILE)).is_file():
        return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits

    digits = load_digits()
    return np.column_stack([digits.data, digits.target])


def _find_idx(folder: Path, split: str, kind: str) -> Path | None:
    stem = f"{IDX_PREFIXES[split]}-{kind}"
    for name in (stem, f"{stem}.gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _read_idx_split(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    images_path = _find_idx(folder, split, IDX_IMAGES)
    labels_path = _find_idx(folder, split, IDX_LABELS)
    if images_path is None or labels_path is None:
        stem = IDX_PREFIXES[split]
        raise DatasetUnavailableError(
            f"{folder} needs both {stem}-{IDX_IMAGES}[.gz] and {stem}-{IDX_LABELS}[.gz]; add the missing file"
        )
    pixels = _as_pixels(read_idx(images_path), str(images_path))
    return pixels, _as_labels(read_idx(labels_path), pixels.shape[0], str(labels_path))


def _read_npz_split(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    with np.load(path, allow_pickle=False) as archive:
        if "x" not in archive or "y" not in archive:
            raise ValueError(f"{path} must hold arrays 'x' (images) and 'y' (labels); it holds {sorted(archive.files)}")
        pixels = _as_pixels(archive["x"], str(path))
        return pixels, _as_labels(archive["y"], pixels.shape[0], str(path))


def _read_folder_split(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Idx files take precedence over ``SPLIT.npz``; None when the folder has neither for this split."""
    if _find_idx(folder, split, IDX_IMAGES) is not None or _find_idx(folder, split, IDX_LABELS) is not None:
        return _read_idx_split(folder, split)
    npz = folder / f"{split}.npz"
    return _read_npz_split(npz) if npz.is_file() else None


def load_image_folder(
    path: str | Path, validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    test_fraction: float = DEFAULT_TEST_FRACTION, seed: int = 0, image_shape: tuple[int, int, int] | None = None,
) -> DataSplits[ImageDataset]:
    """A user's folder of images in class folders (``<class>/*.png``, or ``train/<class>/...`` and
    ``test/<class>/...``: :mod:`~pipetransformer.data.image_folders`, converted to ``image_shape``, the model's
    ``(channels, size, size)``), of Fashion-MNIST-style idx(.gz) files, or ``train.npz``/``test.npz`` (arrays ``x``,
    ``y``; as stored, whatever ``image_shape``).

    Validation is a ``seed``-ed fraction of the training files; test is the folder's test files, or, when it
    has none, another ``seed``-ed fraction of the training files. Classes are the class folders' names (sorted),
    or ``0..max label`` for idx and npz files.
    """
    folder = Path(path)
    usage = (
        f"class folders of images (<class>/*{'|'.join(IMAGE_EXTENSIONS)}, optionally under train/ and test/), "
        f"train-{IDX_IMAGES}[.gz] + train-{IDX_LABELS}[.gz] (and t10k-...), or train.npz/test.npz with arrays x and y"
    )
    if not folder.is_dir():
        raise DatasetUnavailableError(f"no image folder at {folder}; pass a folder holding {usage}")
    train_split = _read_folder_split(folder, "train")
    if train_split is None and (root := class_folder_root(folder)) is not None:
        return _load_class_folders(folder, root, validation_fraction, test_fraction, seed, image_shape)
    if train_split is None:
        raise DatasetUnavailableError(f"{folder} has no training images; it needs {usage}")
    if train_split[1].numel() == 0:
        raise ValueError(f"{folder}: the training split holds no images; add some")
    test_split = _read_folder_split(folder, "test")
    label_sets = [train_split[1]] if test_split is None else [train_split[1], test_split[1]]
    num_classes = max(int(labels.max()) for labels in label_sets if labels.numel() > 0) + 1
    class_names = tuple(str(c) for c in range(num_classes))
    train = ImageDataset(*train_split, class_names)
    test = None if test_split is None else ImageDataset(*test_split, class_names)
    if test is not None and test.image_shape != train.image_shape:
        raise ValueError(
            f"{folder}: train images are {train.image_shape} but test images are {test.image_shape}; use one shape"
        )
    return _normalized(held_out_splits(train, validation_fraction, test_fraction, seed, test=test))


def _load_class_folders(folder: Path, root: Path, validation_fraction: float, test_fraction: float, seed: int,
                        image_shape: tuple[int, int, int] | None) -> DataSplits[ImageDataset]:
    """Training images from ``root``'s class folders; test from ``folder/test`` when ``root`` is ``folder/train``
    and it exists, otherwise a ``seed``-ed fraction of the training images."""
    pixels, labels, class_names = read_class_folders(root, None, image_shape)
    train = ImageDataset(pixels, labels, class_names)
    test_root = folder / "test"
    test = None
    if root != folder and test_root.is_dir():
        if image_shape is None:  # the test images take the training images' shape
            image_shape = train.image_shape
        test = ImageDataset(*read_class_folders(test_root, class_names, image_shape)[:2], class_names)
    return _normalized(held_out_splits(train, validation_fraction, test_fraction, seed, test=test))
