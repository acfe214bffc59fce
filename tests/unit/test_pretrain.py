"""Masked-patch pretraining of the built-in ViT, and its backbone as ``model.path`` for a fine-tune."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipetransformer.cli import EXIT_USER_ERROR, main
from pipetransformer.config import TrainConfig, load_config
from pipetransformer.data import load_datasets
from pipetransformer.models import build_model
from pipetransformer.models.pretrain import masked_patch_pretrain
from pipetransformer.models.vit import save_vit_backbone

TINY_VIT = Path(__file__).resolve().parents[2] / "configs" / "tiny_vit.yaml"
NUM_CLASSES = 10
EPOCHS = 4


def tiny_vit(seed: int = 0, **overrides: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    settings = {**dict(load_config(TINY_VIT).model.vit), **overrides}
    return build_model("vit", num_labels=NUM_CLASSES, vit=settings)


def digits() -> torch.Tensor:
    train = load_datasets("digits", max_train_samples=192).train
    return train.get_batch(list(range(len(train)))).inputs[0]


def test_pretraining_lowers_the_masked_patch_loss_and_leaves_the_head_alone() -> None:
    model = tiny_vit()
    head_before = [p.detach().clone() for p in model.blocks[-1].parameters()]
    layer_before = [p.detach().clone() for p in model.blocks[1].parameters()]
    losses = masked_patch_pretrain(model, digits(), TrainConfig(batch_size=16, lr=1e-3), epochs=EPOCHS, seed=0)
    assert len(losses) == EPOCHS and losses[-1] < 0.8 * losses[0]
    assert all(torch.equal(a, b) for a, b in zip(head_before, model.blocks[-1].parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(layer_before, model.blocks[1].parameters()))


def test_backbone_round_trip_through_model_path(tmp_path: Path) -> None:
    pretrained = tiny_vit(seed=1)
    path = tmp_path / "backbone.safetensors"
    save_vit_backbone(pretrained, path)
    fine_tune = build_model("vit", num_labels=3, path=str(path), vit=dict(load_config(TINY_VIT).model.vit))
    for block in range(len(pretrained) - 1):
        for mine, theirs in zip(fine_tune.blocks[block].parameters(), pretrained.blocks[block].parameters()):
            assert torch.equal(mine, theirs)
    assert fine_tune.blocks[-1].classifier.out_features == 3  # a new head for the fine-tune's own classes


def test_backbone_of_another_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "backbone.safetensors"
    save_vit_backbone(tiny_vit(), path)
    settings = {**dict(load_config(TINY_VIT).model.vit), "dim": 32}
    with pytest.raises(ValueError, match="does not fit model.vit"):
        build_model("vit", num_labels=NUM_CLASSES, path=str(path), vit=settings)


def test_pretrain_command_writes_a_backbone_a_training_config_can_use(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.safetensors"
    assert main(["pretrain", str(TINY_VIT), "--out", str(out), "--epochs", "1"]) == 0
    assert out.is_file() and "set model.path" in capsys.readouterr().out
    config = load_config(TINY_VIT, [f"model.path={out}"])
    loaded = build_model("vit", num_labels=NUM_CLASSES, path=config.model.path, vit=dict(config.model.vit))
    assert not torch.equal(loaded.blocks[1].qkv.weight, tiny_vit().blocks[1].qkv.weight)  # pretrained, not the init
    written = out.stat().st_mtime_ns
    assert main(["pretrain", str(TINY_VIT), "--out", str(out), "--epochs", "1", "--if-missing"]) == 0
    assert out.stat().st_mtime_ns == written and "kept (--if-missing)" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["pretrain", str(TINY_VIT.parent / "tiny_text.yaml"), "--out", "x.safetensors"], "pretrain needs model.kind: vit"),
    (["pretrain", str(TINY_VIT), "--out", "x.safetensors", "--set", "model.path=/nowhere.safetensors"],
     "create a ViT backbone with `pipetransformer pretrain"),
    (["train", str(TINY_VIT), "--set", "model.path=/nowhere.safetensors"], "model.path=/nowhere.safetensors does not"),
    (["pretrain", str(TINY_VIT), "--out", "x.safetensors", "--epochs", "0"], "--epochs must be >= 1"),
])
def test_pretrain_and_model_path_mistakes_are_one_line(args: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == EXIT_USER_ERROR
    assert message in capsys.readouterr().err


@pytest.mark.cuda(devices=1)
def test_pretraining_on_the_device_follows_the_host() -> None:
    """The same seed masks the same patches and visits the same images on either device, so the losses agree."""
    pixels = digits()
    on_host = masked_patch_pretrain(tiny_vit(), pixels, TrainConfig(batch_size=16, lr=1e-3), epochs=2, seed=0)
    on_device = masked_patch_pretrain(tiny_vit().cuda(), pixels, TrainConfig(batch_size=16, lr=1e-3), epochs=2, seed=0)
    assert on_device == pytest.approx(on_host, rel=1e-3)
