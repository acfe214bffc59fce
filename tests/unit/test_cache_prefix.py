"""FrozenPrefixCache: served activations equal a plain forward through the frozen blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from pipetransformer.cache.prefix import FrozenPrefixCache
from pipetransformer.cache.store import ActivationStore
from pipetransformer.models.blocks import Activation, ActivationSpec, BlockSequence

NUM_SAMPLES = 12
MAX_LEN = 10
DIM = 8
HEADS = 2
VOCAB = 30
NUM_LAYERS = 4
NUM_LABELS = 3
BATCH = 4
IMAGE_FEATURES = 6
IMAGE_TOKENS = 3
MIXED_TOLERANCE = 1e-5
LOOSE_BUDGET = 1 << 20
TEXT_SPEC = ActivationSpec(shapes=((MAX_LEN, DIM), (MAX_LEN,)), dtypes=(torch.float32, torch.int64))



class TokenEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(MAX_LEN, DIM)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1])
        return self.tokens(input_ids) + self.positions(positions), attention_mask


class MaskedEncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=2 * DIM, batch_first=True)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer(hidden, src_key_padding_mask=attention_mask == 0), attention_mask


class MeanPoolHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(DIM, NUM_LABELS)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor]:
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (self.classifier((hidden * weights).sum(1) / weights.sum(1)),)


class PatchEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(IMAGE_FEATURES, IMAGE_TOKENS * DIM)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.project(pixels).view(pixels.shape[0], IMAGE_TOKENS, DIM),)


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Dropout(0.5))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (hidden + self.mlp(hidden),)


class FirstTokenHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(DIM, NUM_LABELS)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.classifier(hidden[:, 0]),)


def _text_model() -> BlockSequence:
    torch.manual_seed(0)
    layers = [MaskedEncoderLayer() for _ in range(NUM_LAYERS)]
    return BlockSequence(TokenEmbeddings(), layers, MeanPoolHead(), task="text")


def _image_model() -> BlockSequence:
    torch.manual_seed(0)
    layers = [ResidualMLP() for _ in range(NUM_LAYERS)]
    return BlockSequence(PatchEmbeddings(), layers, FirstTokenHead(), task="image")


def _freeze(model: BlockSequence, boundary: int) -> None:
    model.train()
    for index in range(boundary):
        model.blocks[index].eval()
        model.blocks[index].requires_grad_(False)


def _dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded to MAX_LEN and each sample's real length."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (NUM_SAMPLES, MAX_LEN), generator=generator)
    lengths = torch.randint(2, MAX_LEN + 1, (NUM_SAMPLES,), generator=generator)
    return ids, lengths


def _text_batch(indices: list[int]) -> Activation:
    """A batch padded to its longest sample, as a collate function would."""
    ids, lengths = _dataset()
    rows = torch.tensor(indices)
    longest = int(lengths[rows].max())
    mask = (torch.arange(longest)[None, :] < lengths[rows][:, None]).to(torch.int64)
    return ids[rows, :longest] * mask, mask


def _plain(model: BlockSequence, inputs: Activation, end: int, start: int = 0) -> Activation:
    with torch.no_grad():
        return model.forward_range(inputs, start, end)


def _assert_equal(served: Activation, expected: Activation) -> None:
    assert len(served) == len(expected)
    for got, want in zip(served, expected, strict=True):
        assert torch.equal(got, want)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ActivationStore]:
    with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, LOOSE_BUDGET, tmp_path) as created:
        created.unlink_names()
        yield created


def test_first_and_repeated_batches_equal_plain_forward(store: ActivationStore) -> None:
    model = _text_model()
    boundary = 3
    _freeze(model, boundary)
    cache = FrozenPrefixCache(store)
    indices = [5, 0, 9, 2]
    inputs = _text_batch(indices)
    expected = _plain(model, inputs, boundary)
    _assert_equal(cache.activation_at_boundary(model, inputs, torch.tensor(indices), boundary), expected)
    assert store.lookup(torch.tensor(indices)).tolist() == [boundary] * BATCH
    served = cache.activation_at_boundary(model, inputs, torch.tensor(indices), boundary)
    _assert_equal(served, expected)
    assert not served[0].requires_grad
    metrics = cache.metrics()
    assert (metrics.samples, metrics.hits, metrics.computed, metrics.advanced) == (2 * BATCH, BATCH, BATCH, 0)
    assert metrics.hit_rate == pytest.approx(0.5)
    assert metrics.seconds_saved > 0
    assert metrics.memory_used_bytes == BATCH * TEXT_SPEC.bytes_per_sample


def test_advancing_a_record_equals_computing_the_later_boundary(store: ActivationStore) -> None:
    model = _text_model()
    early, late = 2, 4
    _freeze(model, early)
    cache = FrozenPrefixCache(store)
    indices = [1, 7, 3, 10]
    inputs = _text_batch(indices)
    cache.activation_at_boundary(model, inputs, torch.tensor(indices), early)
    _freeze(model, late)
    served = cache.activation_at_boundary(model, inputs, torch.tensor(indices), late)
    _assert_equal(served, _plain(model, inputs, late))
    assert store.lookup(torch.tensor(indices)).tolist() == [late] * BATCH
    assert cache.metrics().advanced == BATCH


def test_mixed_batches_match_within_rounding_on_real_tokens(store: ActivationStore) -> None:
    """Samples cached from other batches (other padding, other batch size) differ by rounding only."""
    model = _text_model()
    boundary = 2
    _freeze(model, boundary)
    cache = FrozenPrefixCache(store)
    for first_epoch_batch in ([0, 1, 2, 3], [4, 5, 6, 7]):
        cache.activation_at_boundary(model, _text_batch(first_epoch_batch), torch.tensor(first_epoch_batch), 1)
    for first_epoch_batch in ([0, 1, 2, 3], [4, 5, 6, 7]):
        cache.activation_at_boundary(model, _text_batch(first_epoch_batch), torch.tensor(first_epoch_batch), 2)
    mixed = [6, 11, 0, 5, 8]
    inputs = _text_batch(mixed)
    served = cache.activation_at_boundary(model, inputs, torch.tensor(mixed), boundary)
    expected = _plain(model, inputs, boundary)
    real = inputs[1].bool()
    assert torch.equal(served[1], expected[1])
    torch.testing.assert_close(served[0][real], expected[0][real], atol=MIXED_TOLERANCE, rtol=MIXED_TOLERANCE)
    metrics = cache.metrics()
    assert metrics.hits == 3 and metrics.advanced == 8 and metrics.computed == 8 + 2


def test_image_prefix_with_dropout_blocks_in_eval(tmp_path: Path) -> None:
    model = _image_model()
    boundary = 3
    _freeze(model, boundary)
    spec = ActivationSpec(shapes=((IMAGE_TOKENS, DIM),), dtypes=(torch.float32,))
    pixels = torch.randn(BATCH, IMAGE_FEATURES, generator=torch.Generator().manual_seed(2))
    indices = torch.tensor([3, 8, 1, 0])
    with ActivationStore.create(NUM_SAMPLES, spec, LOOSE_BUDGET, tmp_path) as image_store:
        image_store.unlink_names()
        cache = FrozenPrefixCache(image_store)
        expected = _plain(model, (pixels,), boundary)
        for _ in range(2):
            _assert_equal(cache.activation_at_boundary(model, (pixels,), indices, boundary), expected)
        assert cache.metrics().hits == BATCH


@pytest.mark.cuda(devices=1)
def test_a_model_on_the_device_is_served_on_the_device_from_the_host_store(tmp_path: Path) -> None:
    """The store maps host memory: records computed on the device are copied there, and served ones (read whole,
    advanced through newly frozen blocks, or mixed with computed rows) come back on the model's device."""
    model = _image_model().cuda()
    spec = ActivationSpec(shapes=((IMAGE_TOKENS, DIM),), dtypes=(torch.float32,))
    pixels = torch.randn(NUM_SAMPLES, IMAGE_FEATURES, generator=torch.Generator().manual_seed(2)).cuda()
    first, mixed = torch.tensor([3, 8, 1, 0]), torch.tensor([8, 5, 3, 11])
    with ActivationStore.create(NUM_SAMPLES, spec, LOOSE_BUDGET, tmp_path) as image_store:
        image_store.unlink_names()
        cache = FrozenPrefixCache(image_store)
        _freeze(model, 2)
        for _ in range(2):  # computed, then read
            served = cache.activation_at_boundary(model, (pixels[first.cuda()],), first, 2)
            assert served[0].device == pixels.device
            torch.testing.assert_close(served, _plain(model, (pixels[first.cuda()],), 2))
        _freeze(model, 3)  # rows 8 and 3 advance from their records, 5 and 11 are computed
        served = cache.activation_at_boundary(model, (pixels[mixed.cuda()],), mixed, 3)
        assert served[0].device == pixels.device
        torch.testing.assert_close(served, _plain(model, (pixels[mixed.cuda()],), 3))
        assert cache.metrics().advanced == 2


def test_corrupt_disk_record_is_recomputed(tmp_path: Path) -> None:
    model = _text_model()
    boundary = 2
    _freeze(model, boundary)
    index_only_budget = 320  # 12 samples: boundary, checksum and sequence arrays (288 bytes), no record
    with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, index_only_budget, tmp_path) as disk_store:
        assert disk_store.layout.memory_records == 0
        cache = FrozenPrefixCache(disk_store)
        indices = [4, 9, 2, 6]
        inputs = _text_batch(indices)
        expected = _plain(model, inputs, boundary)
        cache.activation_at_boundary(model, inputs, torch.tensor(indices), boundary)
        extent = disk_store.record_extents(9)
        assert extent is not None
        with open(extent[0].path, "r+b") as disk_file:
            disk_file.seek(extent[0].offset)
            disk_file.write(b"\xff" * extent[0].nbytes)
        disk_store.unlink_names()
        served = cache.activation_at_boundary(model, inputs, torch.tensor(indices), boundary)
        torch.testing.assert_close(served[0], expected[0], atol=MIXED_TOLERANCE, rtol=MIXED_TOLERANCE)
        assert torch.equal(served[1], expected[1])
        metrics = cache.metrics()
        assert metrics.corrupt == 1 and metrics.hits == BATCH - 1
        assert disk_store.lookup(torch.tensor([9])).tolist() == [boundary]
        assert disk_store.read(torch.tensor([9])).served.all()


def test_unfrozen_block_is_refused(store: ActivationStore) -> None:
    model = _text_model()
    _freeze(model, 1)
    cache = FrozenPrefixCache(store)
    inputs = _text_batch([0, 1])
    with pytest.raises(ValueError, match="block 1 is not frozen"):
        cache.activation_at_boundary(model, inputs, torch.tensor([0, 1]), 2)


def test_boundary_zero_is_the_inputs(store: ActivationStore) -> None:
    model = _text_model()
    inputs = _text_batch([0, 1])
    assert FrozenPrefixCache(store).activation_at_boundary(model, inputs, torch.tensor([0, 1]), 0) is inputs
