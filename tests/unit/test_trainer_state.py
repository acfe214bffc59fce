"""The training state a checkpoint carries, in one process on the tiny text model: persistent buffers too."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import pipetransformer.train.build as build_module
from pipetransformer.config import load_config
from pipetransformer.models import BlockSequence, build_model
from pipetransformer.train import Trainer
from pipetransformer.train.recorder import bar_samples

ROOT = Path(__file__).resolve().parents[2]
BUFFER = "batches_seen"


def _count_training_batches(module: nn.Module, inputs: Any) -> None:
    if module.training:
        getattr(module, BUFFER).add_(1)


def _with_a_running_statistic(*args: Any, **kwargs: Any) -> BlockSequence:
    """The real tiny model, its head keeping a persistent running statistic (as BatchNorm's num_batches_tracked)."""
    model = build_model(*args, **kwargs)
    head = model.blocks[-1]
    head.register_buffer(BUFFER, torch.zeros((), dtype=torch.int64))
    head.register_forward_pre_hook(_count_training_batches)
    return model


def _fit(run_dir: Path, *overrides: str) -> Trainer:
    trainer = Trainer(load_config(ROOT / "configs" / "tiny_text.yaml", [f"run.dir={run_dir}", *overrides]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


def test_persistent_buffers_are_checkpointed_and_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_module, "build_model", _with_a_running_statistic)
    reference = _fit(tmp_path / "reference", "train.epochs=1")
    _fit(tmp_path / "stopped", "train.epochs=1", "train.max_steps=3")
    resumed = _fit(tmp_path / "stopped", "train.epochs=1", "checkpoint.resume=auto")
    assert resumed.progress.restarts == 1 and resumed.progress.step == reference.progress.step == 8
    counted = getattr(resumed.model.blocks[-1], BUFFER)
    assert int(counted) == int(getattr(reference.model.blocks[-1], BUFFER)) == 8, "the buffer did not resume"
    for (name, tensor), expected in zip(resumed.model.state_dict().items(), reference.model.state_dict().values(),
                                        strict=True):
        assert torch.equal(tensor, expected), f"{name} differs after resume"


@pytest.mark.cuda
def test_a_resumed_optimizer_keeps_its_state_on_the_device(tmp_path: Path) -> None:
    """A checkpoint's CPU tensors are restored onto the parameters' device, which fused AdamW requires."""
    cuda = ("dist.device=cuda", "train.epochs=1")
    _fit(tmp_path, *cuda, "train.max_steps=3")
    resumed = _fit(tmp_path, *cuda, "checkpoint.resume=auto")
    assert resumed.progress.step == 8 and resumed.optimizer is not None
    for param, state in resumed.optimizer.state.items():
        assert all(value.device == param.device for value in state.values() if isinstance(value, torch.Tensor))


def test_the_cache_disk_level_defaults_to_node_local_temporary_storage(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The run directory is shared storage on several nodes; the disk level is per node, so it goes to TMPDIR."""
    node_local = tmp_path / "node-local-tmp"
    node_local.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(node_local))  # what TMPDIR sets
    run_dir = tmp_path / "run"
    trainer = Trainer(load_config(ROOT / "configs" / "tiny_text.yaml", [
        f"run.dir={run_dir}", "train.max_steps=2", "freeze.enabled=true", "freeze.policy=schedule",
        "freeze.interval_unit=steps", "freeze.schedule=[[1,2]]", "cache.enabled=true", "cache.memory_gb=1e-5"]))
    try:
        trainer.fit()
        assert trainer.cache.store is not None and trainer.cache.store.layout.disk_records > 0
        assert Path(str(trainer.cache.store.layout.disk_path)).parent == node_local
    finally:
        trainer.close()
    assert not (run_dir / "cache").exists()


def test_the_saved_model_is_written_owner_only_and_atomically(tmp_path: Path) -> None:
    """run.save_model goes through the checkpoint writer: 0600 whatever the umask, no temporary file left."""
    previous = os.umask(0o022)
    try:
        _fit(tmp_path, "train.max_steps=1", "run.save_model=true", "checkpoint.enabled=false")
    finally:
        os.umask(previous)
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    assert load_file(str(tmp_path / "model.safetensors")), "an empty model file"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary file was left"


def test_the_bar_ends_at_max_steps_and_a_max_steps_beyond_the_epochs_is_said(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """tiny_text: 256 training rows in batches of 32, 8 steps an epoch. max_steps=3 shortens the bar to 3 batches;
    max_steps=100 on one epoch cannot be reached, and the run says so before its first step."""
    short = Trainer(load_config(ROOT / "configs" / "tiny_text.yaml", [f"run.dir={tmp_path / 'a'}",
                                                                      "train.max_steps=3"]))
    try:
        assert bar_samples(short._total_samples(), 3, short.layout.global_batch()) == 3 * 32 < short._total_samples()
    finally:
        short.close()
    with caplog.at_level("WARNING"):
        _fit(tmp_path / "b", "train.epochs=1", "train.max_steps=100", "checkpoint.enabled=false")
    assert "train.max_steps=100 is more than the 8 steps of train.epochs=1" in caplog.text
