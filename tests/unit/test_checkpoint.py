"""Checkpoint storage: bit-exact round trips, rotation, corruption fallback, failing disks, no pickle."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import resource
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipetransformer.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST_FILE,
    META_CONFIG_KEY,
    META_FINGERPRINT_KEY,
    OPTIMIZER_FILE,
    TMP_PREFIX,
    WEIGHTS_FILE,
    CheckpointError,
    check_compatible,
    check_is_a_checkpoint,
    checkpoint_dir_name,
    latest_valid_checkpoint,
    load_checkpoint,
    model_fingerprint,
    save_checkpoint,
    write_tensors,
)

LOGGER = "pipetransformer.checkpoint"
DROP_FILE_PERMISSION_OVERRIDES = ["setpriv", "--inh-caps=-all",
                                  "--bounding-set=-dac_override,-dac_read_search,-fowner"]
"""Root ignores file modes; without these capabilities a read-only directory is read-only for it too."""
FILE_SIZE_LIMIT = 16 * 1024
"""RLIMIT_FSIZE in the child processes: smaller than the checkpoint they try to write."""
LARGE_WEIGHT_ELEMENTS = 32 * 1024
SUBPROCESS_TIMEOUT_S = 120

CHILD_SAVE = """
import resource, signal, sys, torch
from pathlib import Path
from pipetransformer.checkpoint import CheckpointError, save_checkpoint
crash, limit, elements, directories = sys.argv[1] == "crash", int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
if crash:
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
for directory in directories:
    try:
        save_checkpoint(Path(directory), 2, {"w": torch.ones(elements)}, {}, {"step": 2}, keep=1)
    except CheckpointError as err:
        print(err)
    else:
        print("saved")
"""


def _state(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    torch.manual_seed(seed)
    weights = {
        "blocks.0.weight": torch.randn(3, 4),
        "blocks.0.bias": torch.tensor([-0.0, float("inf"), float("-inf"), 1e-45]),
        "blocks.1.weight": torch.randn(2, 5).to(torch.bfloat16),
        "blocks.1.half": torch.randn(7).to(torch.float16),
        "blocks.2.position_ids": torch.arange(6, dtype=torch.int64).reshape(1, 6) * (2**40),
        "blocks.2.flag": torch.tensor([True, False]),
        "blocks.2.scale": torch.tensor(0.125),
        "blocks.2.empty": torch.zeros(0, 3),
        "blocks.3.weight.t": torch.randn(4, 3).t(),
    }
    optimizer = {
        "blocks.0.weight.exp_avg": torch.randn(3, 4),
        "blocks.0.weight.exp_avg_sq": torch.rand(3, 4),
        "blocks.0.weight.step": torch.tensor(17.0),
        "blocks.1.weight.exp_avg": torch.randn(2, 5).to(torch.bfloat16),
        "blocks.2.counter": torch.tensor(2**62, dtype=torch.int64),
    }
    meta = {
        "step": 17,
        "epoch": 1,
        "sampler": {"num_samples": 10, "seed": 0, "shuffle": True, "epoch": 1, "position": 4},
        "freeze": {"policy": "gradient", "frozen": [0, 1], "last_step": None},
        "history": [{"step": 1, "loss": 0.6931471805599453}, {"step": 2, "loss": 1e-300}],
        "rng": torch.get_rng_state().tolist(),
        META_CONFIG_KEY: {"seed": 0, "model": {"kind": "vit"}, "data": {"name": "digits"}},
        META_FINGERPRINT_KEY: model_fingerprint(weights),
    }
    return weights, optimizer, meta


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_exact(loaded: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == original.keys()
    for name, tensor in original.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(_bits(loaded[name]), _bits(tensor)), name


def _save(directory: Path, step: int, keep: int = 10, seed: int = 0) -> Path:
    weights, optimizer, meta = _state(seed)
    return save_checkpoint(directory, step, weights, optimizer, {**meta, "step": step}, keep=keep).path


def _steps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """What a hand-made manifest with a correct self-hash looks like (the format's documented rule)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    manifest = {**body, "manifest_sha256": hashlib.sha256(canonical).hexdigest()}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    weights, optimizer, meta = _state()
    saved = save_checkpoint(tmp_path, 17, weights, optimizer, meta, keep=2)
    assert saved.path == tmp_path / "step-000000017"
    assert saved.bytes_written == sum(f.stat().st_size for f in saved.path.iterdir())
    assert saved.seconds > 0 and not saved.skipped
    for loaded in (load_checkpoint(saved.path), latest_valid_checkpoint(tmp_path)):
        assert loaded is not None
        assert loaded.step == 17 and loaded.path == saved.path
        _assert_bit_exact(loaded.weights, weights)
        _assert_bit_exact(loaded.optimizer, optimizer)
        assert loaded.meta == meta


def test_files_and_directories_are_owner_only(tmp_path: Path) -> None:
    root = tmp_path / "new" / "checkpoints"
    path = _save(root, 1)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for name in (WEIGHTS_FILE, OPTIMIZER_FILE, MANIFEST_FILE):
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o600


def test_keeps_the_newest_n(tmp_path: Path) -> None:
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert _steps(tmp_path) == [checkpoint_dir_name(4), checkpoint_dir_name(5)]
    latest = latest_valid_checkpoint(tmp_path)
    assert latest is not None and latest.step == 5


def test_rotation_counts_only_valid_checkpoints(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    _flip_byte(tmp_path / checkpoint_dir_name(3) / WEIGHTS_FILE)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _save(tmp_path, 4, keep=2)
    assert _steps(tmp_path) == [checkpoint_dir_name(2), checkpoint_dir_name(4)]
    assert checkpoint_dir_name(3) in caplog.text


def _truncate(path: Path) -> None:
    weights = path / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-7])


def _flip_optimizer(path: Path) -> None:
    """The last byte is tensor data: only the hash can tell."""
    _flip_byte(path / OPTIMIZER_FILE)


def _delete_optimizer(path: Path) -> None:
    (path / OPTIMIZER_FILE).unlink()


def _garbage_manifest(path: Path) -> None:
    (path / MANIFEST_FILE).write_bytes(b'{"format": "pipetransformer-checkpoint", "step"')


def _empty_manifest(path: Path) -> None:
    (path / MANIFEST_FILE).write_bytes(b"")


def _edited_meta(path: Path) -> None:
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["meta"]["epoch"] += 1
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def _swapped_step(path: Path) -> None:
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["step"] = 1
    _rewrite_manifest(path, manifest)


def _weights_hash_matches_other_file(path: Path) -> None:
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][WEIGHTS_FILE] = manifest["files"][OPTIMIZER_FILE]
    _rewrite_manifest(path, manifest)


@pytest.mark.parametrize("damage", [_truncate, _flip_optimizer, _delete_optimizer, _garbage_manifest, _empty_manifest,
                                    _edited_meta, _swapped_step, _weights_hash_matches_other_file])
def test_damaged_newest_falls_back_to_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any) -> None:
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2, seed=1)
    damage(newest)
    with pytest.raises(CheckpointError, match="is corrupt") as raised:
        load_checkpoint(newest)
    assert "\n" not in str(raised.value)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        latest = latest_valid_checkpoint(tmp_path)
    assert latest is not None and latest.step == 1
    _assert_bit_exact(latest.weights, _state(0)[0])
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert str(newest) in caplog.records[0].getMessage()


def test_unknown_format_version_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["format_version"] += 1
    _rewrite_manifest(path, manifest)
    with pytest.raises(CheckpointError, match="format version"):
        load_checkpoint(path)


def test_a_resume_path_that_is_not_one_checkpoint_says_what_to_give(tmp_path: Path) -> None:
    """A missing path, a file, a run directory or its checkpoints folder: each named, with the newest inside."""
    run_dir = tmp_path / "run"
    _save(run_dir / CHECKPOINTS_DIR, 3)
    newest = _save(run_dir / CHECKPOINTS_DIR, 5)
    check_is_a_checkpoint(newest)
    (run_dir / "summary.json").write_text("{}")
    for path, words in [(tmp_path / "nowhere", "does not exist"), (run_dir / "summary.json", "is a file"),
                        (run_dir, str(newest)), (run_dir / CHECKPOINTS_DIR, str(newest))]:
        for check in (check_is_a_checkpoint, load_checkpoint):
            with pytest.raises(CheckpointError, match="--resume alone") as raised:
                check(path)
            assert words in str(raised.value)
    unfinished = tmp_path / "unfinished"  # a directory without a manifest may be a damaged checkpoint
    unfinished.mkdir()
    check_is_a_checkpoint(unfinished)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(unfinished)


def test_nothing_valid_gives_none(tmp_path: Path) -> None:
    assert latest_valid_checkpoint(tmp_path / "missing") is None
    assert latest_valid_checkpoint(tmp_path) is None
    _garbage_manifest(_save(tmp_path, 1))
    assert latest_valid_checkpoint(tmp_path) is None


def test_same_step_is_skipped_if_identical_refused_if_different(tmp_path: Path) -> None:
    first = _save(tmp_path, 3)
    manifest_before = (first / MANIFEST_FILE).read_bytes()
    weights, optimizer, meta = _state()
    again = save_checkpoint(tmp_path, 3, weights, optimizer, {**meta, "step": 3}, keep=2)
    assert again.skipped and again.bytes_written == 0 and again.path == first
    with pytest.raises(CheckpointError, match="already exists with different contents"):
        save_checkpoint(tmp_path, 3, weights, optimizer, {**meta, "step": 3, "epoch": 9}, keep=2)
    weights["blocks.0.weight"][0, 0] += 1
    with pytest.raises(CheckpointError, match="already exists with different contents"):
        save_checkpoint(tmp_path, 3, weights, optimizer, {**meta, "step": 3}, keep=2)
    assert (first / MANIFEST_FILE).read_bytes() == manifest_before


def test_same_step_that_does_not_verify_is_replaced(tmp_path: Path) -> None:
    _truncate(_save(tmp_path, 3))
    weights, optimizer, meta = _state(seed=5)
    saved = save_checkpoint(tmp_path, 3, weights, optimizer, meta, keep=2)
    assert not saved.skipped
    _assert_bit_exact(load_checkpoint(saved.path).weights, weights)
    assert _steps(tmp_path) == [checkpoint_dir_name(3)]


class _PlantsMarker:
    """A pickle that, if ever unpickled, creates a file: loading must never get that far."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (str(self.marker), "w")


def test_pickle_payload_with_valid_hashes_is_never_unpickled(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    marker = tmp_path.parent / f"{tmp_path.name}-unpickled"
    payload = pickle.dumps(_PlantsMarker(marker))
    (path / WEIGHTS_FILE).write_bytes(payload)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][WEIGHTS_FILE] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    _rewrite_manifest(path, manifest)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_checkpoint(path)
    (path / MANIFEST_FILE).write_bytes(payload)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(path)
    assert not marker.exists()
    pickle.loads(payload)
    assert marker.exists(), "the payload is live: the test above would have caught an unpickling loader"
    marker.unlink()


def test_fingerprint_depends_on_names_shapes_dtypes_not_values() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 3)
    reference = model_fingerprint(model.named_parameters())
    assert reference == model_fingerprint({n: torch.zeros_like(p) for n, p in model.named_parameters()})
    assert reference == model_fingerprint({"bias": ((3,), "float32"), "weight": ([3, 2], torch.float32)})
    assert reference != model_fingerprint(torch.nn.Linear(2, 4).named_parameters())
    assert reference != model_fingerprint(model.to(torch.bfloat16).named_parameters())
    assert reference != model_fingerprint({"bias2": ((3,), "float32"), "weight": ([3, 2], torch.float32)})


def test_incompatible_checkpoint_says_why(tmp_path: Path) -> None:
    weights, _, meta = _state()
    loaded = load_checkpoint(_save(tmp_path, 1))
    check_compatible(loaded.meta, model_fingerprint=model_fingerprint(weights), config=meta[META_CONFIG_KEY])
    other = model_fingerprint({**weights, "extra.bias": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="different model .*use the model config it was saved with"):
        check_compatible(loaded.meta, model_fingerprint=other)
    config = {"seed": 0, "model": {"kind": "vit"}, "data": {"name": "fashion_mnist"}, "train": {"optimizer": "sgd"}}
    with pytest.raises(CheckpointError) as raised:
        check_compatible(loaded.meta, model_fingerprint=model_fingerprint(weights), config=config)
    message = str(raised.value)
    assert 'data.name="digits" (this run: "fashion_mnist")' in message
    assert 'train.optimizer=null (this run: "sgd")' in message
    assert "seed" not in message and "\n" not in message
    with pytest.raises(CheckpointError, match=f"no {META_FINGERPRINT_KEY}"):
        check_compatible({}, model_fingerprint=other)


def test_meta_must_be_json(tmp_path: Path) -> None:
    weights, optimizer, _ = _state()
    with pytest.raises(CheckpointError, match="not JSON-serializable"):
        save_checkpoint(tmp_path, 1, weights, optimizer, {"when": object()}, keep=1)
    assert list(tmp_path.iterdir()) == []


def _run_child_save(directories: list[Path], crash: bool = False,
                    prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Saves step 2 into each directory in a fresh process (one torch import for all)."""
    command = [*(prefix or []), sys.executable, "-c", CHILD_SAVE, "crash" if crash else "save", str(FILE_SIZE_LIMIT),
               str(LARGE_WEIGHT_ELEMENTS), *map(str, directories)]
    return subprocess.run(command, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False)


def _unprivileged_prefix() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which(DROP_FILE_PERMISSION_OVERRIDES[0]) is None:
        pytest.skip("running as root without setpriv: cannot make a directory read-only for this process")
    probe = subprocess.run([*DROP_FILE_PERMISSION_OVERRIDES, "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot drop file-permission capabilities: {probe.stderr.decode().strip()}")
    return DROP_FILE_PERMISSION_OVERRIDES


def test_read_only_directory_is_a_one_line_error_and_keeps_old_checkpoints(tmp_path: Path) -> None:
    prefix = _unprivileged_prefix()
    _save(tmp_path, 1)
    targets = [tmp_path, tmp_path / "new" / "checkpoints"]
    os.chmod(tmp_path, 0o500)
    try:
        result = _run_child_save(targets, prefix=prefix)
    finally:
        os.chmod(tmp_path, 0o700)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"cannot write checkpoint to {target}: Permission denied; free space or set checkpoint.dir"
        for target in targets
    ]
    assert _steps(tmp_path) == [checkpoint_dir_name(1)]
    _assert_bit_exact(load_checkpoint(tmp_path / checkpoint_dir_name(1)).weights, _state(0)[0])


def test_full_disk_is_a_one_line_error_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """A file-size limit makes writes fail like a full disk (EFBIG instead of ENOSPC; Python ignores
    SIGXFSZ), in this process: only the soft limit is lowered, and it is restored at once."""
    _save(tmp_path, 1)
    weights = {"w": torch.ones(LARGE_WEIGHT_ELEMENTS)}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, hard))
    try:
        with pytest.raises(CheckpointError) as raised:
            save_checkpoint(tmp_path, 2, weights, {}, {}, keep=1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(raised.value) == (f"cannot write checkpoint to {tmp_path}: File too large; "
                                 "free space or set checkpoint.dir")
    assert _steps(tmp_path) == [checkpoint_dir_name(1)]
    latest = latest_valid_checkpoint(tmp_path)
    assert latest is not None and latest.step == 1


def test_crash_mid_write_leaves_a_tmp_dir_that_is_ignored_then_cleaned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tmp_path, 1)
    result = _run_child_save([tmp_path], crash=True)
    assert result.returncode == -signal.SIGXFSZ, (result.returncode, result.stdout, result.stderr)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]
    assert len(leftovers) == 1 and (leftovers[0] / WEIGHTS_FILE).exists()
    finished_looking = tmp_path / f"{TMP_PREFIX}{checkpoint_dir_name(9)}-copy"
    shutil.copytree(tmp_path / checkpoint_dir_name(1), finished_looking)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        latest = latest_valid_checkpoint(tmp_path)
    assert latest is not None and latest.step == 1
    assert caplog.records == []
    _save(tmp_path, 3, keep=2)
    assert _steps(tmp_path) == [checkpoint_dir_name(1), checkpoint_dir_name(3)]


def test_write_tensors_replaces_a_file_whole_and_owner_only(tmp_path: Path) -> None:
    """What run.save_model writes: 0600 whatever the old file's mode, and a failed write (here a full disk) leaves
    the previous file as it was, with no temporary file behind."""
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"previous")
    os.chmod(target, 0o644)
    write_tensors(target, {"w": torch.arange(4.0)}, "model")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    _assert_bit_exact(load_file(str(target)), {"w": torch.arange(4.0)})
    previous = target.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, hard))
    try:
        with pytest.raises(CheckpointError, match=f"cannot write {target}: File too large"):
            write_tensors(target, {"w": torch.ones(LARGE_WEIGHT_ELEMENTS)}, "model")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert target.read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]
