"""Checkpoint storage: atomic, verified, rotated; safetensors + JSON only, so loading never runs pickle.

One directory per checkpoint, named after its step::

    <dir>/step-000000123/
        weights.safetensors     every parameter and persistent buffer, by name (layout-independent)
        optimizer.safetensors   "<param name>.<state key>" -> tensor
        manifest.json           format version, step, size + sha256 of each file, the caller's metadata,
                                and a sha256 of the manifest itself

A checkpoint is written into a hidden sibling ``.tmp-*`` directory, every file and the directory are
fsynced, and only then is it renamed to its final name, so a crash leaves the previous set of
checkpoints plus at most a ``.tmp-*`` leftover that nothing reads and the next save deletes. Loading
checks sizes and hashes before deserializing anything: a truncated or bit-flipped checkpoint is
reported as corrupt and :func:`latest_valid_checkpoint` falls back to the one before it.

One writer per directory: rank 0 of one run. The metadata is the caller's; :func:`check_compatible`
reads its ``model_fingerprint`` and ``config`` entries (:data:`META_FINGERPRINT_KEY`,
:data:`META_CONFIG_KEY`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "META_CONFIG_KEY",
    "META_FINGERPRINT_KEY",
    "OPTIMIZER_FILE",
    "RESUME_CONFIG_KEYS",
    "TMP_PREFIX",
    "WEIGHTS_FILE",
    "Checkpoint",
    "CheckpointError",
    "SavedCheckpoint",
    "check_compatible",
    "checkpoint_dir_name",
    "latest_valid_checkpoint",
    "load_checkpoint",
    "model_fingerprint",
    "save_checkpoint",
    "write_tensors",
]

logger = logging.getLogger(__name__)

FORMAT_NAME = "pipetransformer-checkpoint"
FORMAT_VERSION = 1
"""Bump when the layout changes; a loader refuses versions it does not know."""
WEIGHTS_FILE = "weights.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
MANIFEST_FILE = "manifest.json"
CHECKPOINTS_DIR = "checkpoints"
"""Under the run directory, unless ``checkpoint.dir`` says where."""
TMP_PREFIX = ".tmp-"
"""Unfinished (or crashed) writes; never read, deleted after the next successful save."""
META_FINGERPRINT_KEY = "model_fingerprint"
META_CONFIG_KEY = "config"
RESUME_CONFIG_KEYS: tuple[str, ...] = (
    "seed",
    "model.kind",
    "model.path",
    "model.hf_config",
    "model.pooling",
    "model.vit",
    "data.name",
    "data.path",
    "data.test_path",
    "data.text_column",
    "data.label_column",
    "data.max_length",
    "data.split_seed",
    "data.validation_fraction",
    "data.test_fraction",
    "data.max_train_samples",
    "train.optimizer",
)
"""Config entries that change what a checkpoint's tensors or sample order mean; batch size, epochs,
layout and the like may change across a resume (elastic training)."""

_STEP_DIGITS = 9
_STEP_DIR = re.compile(r"step-(\d+)")
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_MANIFEST_HASH_KEY = "manifest_sha256"
_FINGERPRINT_SHOWN = 12
"""Hex digits of a fingerprint shown in messages: enough to tell two apart."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or used; the one-line message says what to do."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    meta: dict[str, Any]


@dataclass(frozen=True)
class SavedCheckpoint:
    """What a save cost, for the trainer's metrics. ``skipped``: an identical checkpoint already existed."""

    path: Path
    step: int
    bytes_written: int
    seconds: float
    skipped: bool = False


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:0{_STEP_DIGITS}d}"


def model_fingerprint(
    weights_or_shapes: Mapping[str, Any] | Iterable[tuple[str, Any]],
) -> str:
    """sha256 over tensor names, shapes and dtypes (not values): the same architecture resumes, another one
    is refused. Takes ``{name: tensor}`` (``model.state_dict()``), ``{name: (shape, dtype)}`` or
    ``model.named_parameters()``."""
    items = weights_or_shapes.items() if isinstance(weights_or_shapes, Mapping) else weights_or_shapes
    entries = []
    for name, value in items:
        if isinstance(value, torch.Tensor):
            shape, dtype = value.shape, value.dtype
        else:
            shape, dtype = value
        entries.append([str(name), [int(d) for d in shape], str(dtype).removeprefix("torch.")])
    entries.sort()
    return hashlib.sha256(_canonical(entries)).hexdigest()


def check_compatible(
    meta: Mapping[str, Any],
    *,
    model_fingerprint: str,
    config: Mapping[str, Any] | None = None,
    config_keys: Sequence[str] = RESUME_CONFIG_KEYS,
) -> None:
    """Refuse to resume a checkpoint written by another model or by a config that changes its meaning."""
    stored = meta.get(META_FINGERPRINT_KEY)
    if stored is None:
        raise CheckpointError(f"checkpoint metadata has no {META_FINGERPRINT_KEY}, so it cannot be checked against "
                              "this model: resume from one written by this trainer or use a new checkpoint.dir")
    if stored != model_fingerprint:
        raise CheckpointError(
            f"checkpoint is from a different model (parameter names/shapes/dtypes fingerprint "
            f"{str(stored)[:_FINGERPRINT_SHOWN]}, this model {model_fingerprint[:_FINGERPRINT_SHOWN]}): "
            "use the model config it was saved with, or a new checkpoint.dir"
        )
    if config is None:
        return
    saved_config = meta.get(META_CONFIG_KEY)
    if not isinstance(saved_config, Mapping):
        raise CheckpointError(f"checkpoint metadata has no {META_CONFIG_KEY}: resume from a checkpoint written "
                              "by this trainer or use a new checkpoint.dir")
    differences = []
    for key in config_keys:
        then, now = json.dumps(_dotted(saved_config, key)), json.dumps(_dotted(config, key), default=str)
        if json.loads(then) != json.loads(now):
            differences.append(f"{key}={then} (this run: {now})")
    if differences:
        raise CheckpointError(f"checkpoint was saved with {', '.join(differences)}: set these as in the checkpoint "
                              "to resume, or use a new checkpoint.dir")


def save_checkpoint(
    directory: Path,
    step: int,
    weights: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    keep: int,
) -> SavedCheckpoint:
    """Write ``<directory>/step-<step>`` atomically, then keep it and the ``keep - 1`` newest other valid
    checkpoints and delete the rest (older or corrupt ones, ``.tmp-*`` leftovers).

    An existing checkpoint of the same step is never overwritten: identical contents are skipped
    (``skipped=True``), different contents raise :class:`CheckpointError`. An existing directory of that
    step that does not verify is not a checkpoint and is replaced. On any write failure (disk full,
    read-only) the previous checkpoints are left as they were.
    """
    if step < 0 or keep < 1:
        raise ValueError(f"need step >= 0 and keep >= 1, got step={step}, keep={keep}")
    start = time.perf_counter()
    directory = Path(directory)
    body, payloads = _manifest_body(step, weights, optimizer, meta)
    final = directory / checkpoint_dir_name(step)
    replace_corrupt = False
    if final.exists():
        try:
            existing, _ = _read_verified(final)
        except CheckpointError as err:
            logger.warning("replacing %s, which does not verify: %s", final, err)
            replace_corrupt = True
        else:
            if (existing["files"], existing["meta"]) != (body["files"], body["meta"]):
                raise CheckpointError(f"checkpoint {final} already exists with different contents: delete it "
                                      "or use a new checkpoint.dir")
            seconds = time.perf_counter() - start
            logger.info("checkpoint %s already holds step %d with identical contents: not rewritten", final, step)
            return SavedCheckpoint(final, step, 0, seconds, skipped=True)
    try:
        written = _write_atomically(directory, final, body, payloads, replace_corrupt)
    except OSError as err:
        raise CheckpointError(f"cannot write checkpoint to {directory}: {err.strerror or err}; "
                              "free space or set checkpoint.dir") from err
    _rotate(directory, final, keep)
    seconds = time.perf_counter() - start
    logger.info("saved checkpoint %s: %d bytes in %.3f s", final, written, seconds)
    return SavedCheckpoint(final, step, written, seconds)


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor], what: str) -> int:
    """``tensors`` as one safetensors file at ``path``, written as checkpoint files are: owner-only, fsynced,
    then renamed into place, so a reader finds the previous file or the whole new one. Returns its bytes."""
    path = Path(path)
    data = _serialize(tensors, what)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}-", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(tmp, path)
        _fsync_dir(path.parent)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {path}: {err.strerror or err}; free space or set run.dir") from err
    return len(data)


def check_is_a_checkpoint(path: Path) -> None:
    """Raise CheckpointError when ``path`` is not one checkpoint directory at all (missing, a file, or a folder of
    checkpoints such as a run's ``checkpoints/``), naming what to give instead; its contents are not verified."""
    path = Path(path)
    if (path / MANIFEST_FILE).is_file():
        return
    newest_in_run = "or --resume alone (with --set run.dir=RUN) for the newest valid one in that run"
    if not path.is_dir():
        what = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
        example = f"RUN/{CHECKPOINTS_DIR}/{checkpoint_dir_name(100)}"
        raise CheckpointError(f"checkpoint {path} {what}: give one checkpoint directory (e.g. {example}) "
                              f"{newest_in_run}")
    held = _step_dirs(path) or _step_dirs(path / CHECKPOINTS_DIR)
    if held:
        raise CheckpointError(f"{path} holds checkpoints rather than being one: give one of them (the newest is "
                              f"{held[0][1]}) {newest_in_run}")


def load_checkpoint(path: Path) -> Checkpoint:
    """Verify sizes and hashes, then deserialize (safetensors and JSON only). Raises CheckpointError."""
    path = Path(path)
    check_is_a_checkpoint(path)
    manifest, payloads = _read_verified(path)
    tensors = {}
    for name, data in payloads.items():
        try:
            tensors[name] = load_tensors(data)
        except SafetensorError as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise _corrupt(path, f"{name} is not a valid safetensors file ({reason})") from err
    return Checkpoint(path=path, step=int(manifest["step"]), weights=tensors[WEIGHTS_FILE],
                      optimizer=tensors[OPTIMIZER_FILE], meta=manifest["meta"])


def latest_valid_checkpoint(directory: Path) -> Checkpoint | None:
    """The newest checkpoint that verifies; each newer one that does not is skipped with a warning."""
    for _, path in _step_dirs(Path(directory)):
        try:
            return load_checkpoint(path)
        except CheckpointError as err:
            logger.warning("skipping checkpoint %s: %s", path, err)
    return None


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _dotted(values: Mapping[str, Any], key: str) -> Any:
    node: Any = values
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _serialize(tensors: Mapping[str, torch.Tensor], what: str) -> bytes:
    try:
        return save_tensors({name: t.detach().cpu().contiguous() for name, t in tensors.items()})
    except (ValueError, RuntimeError, SafetensorError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"cannot serialize the {what} tensors ({reason}): pass tensors that do not "
                              "share memory (clone them)") from err


def _manifest_body(step: int, weights: Mapping[str, torch.Tensor], optimizer: Mapping[str, torch.Tensor],
                   meta: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest without its own hash, and the file contents it describes.

    The metadata goes through a JSON round trip first, so what is hashed is exactly what a reader parses
    back (tuples become lists, integer keys strings)."""
    try:
        plain_meta = json.loads(json.dumps(dict(meta)))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint metadata is not JSON-serializable ({err}): pass only dicts, lists, "
                              "strings, numbers, booleans and None") from err
    payloads = {WEIGHTS_FILE: _serialize(weights, "weights"), OPTIMIZER_FILE: _serialize(optimizer, "optimizer")}
    files = {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in payloads.items()}
    body = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step, "files": files, "meta": plain_meta}
    return body, payloads


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(directory: Path, final: Path, body: dict[str, Any], payloads: dict[str, bytes],
                      replace_corrupt: bool) -> int:
    """Returns the bytes written. Raises OSError with nothing new left behind but a ``.tmp-*`` directory
    if even its removal failed."""
    if not directory.is_dir():
        directory.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        _fsync_dir(directory.parent)
    manifest = {**body, _MANIFEST_HASH_KEY: hashlib.sha256(_canonical(body)).hexdigest()}
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=directory))
    try:
        os.chmod(tmp, _DIR_MODE)
        for name, data in payloads.items():
            _write_file(tmp / name, data)
        _write_file(tmp / MANIFEST_FILE, manifest_bytes)
        _fsync_dir(tmp)
        if replace_corrupt:
            os.rename(final, directory / f"{TMP_PREFIX}corrupt-{final.name}-{os.getpid()}")
        os.rename(tmp, final)
        _fsync_dir(directory)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sum(len(data) for data in payloads.values()) + len(manifest_bytes)


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """Checkpoint directories, newest step first; ``.tmp-*`` and anything else are ignored."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as err:
        logger.warning("could not delete old checkpoint data %s: %s", path, err)


def _rotate(directory: Path, saved: Path, keep: int) -> None:
    kept = 1
    for _, path in _step_dirs(directory):
        if path == saved:
            continue
        if kept < keep:
            try:
                _read_verified(path)
            except CheckpointError as err:
                logger.warning("deleting checkpoint %s, which does not verify: %s", path, err)
            else:
                kept += 1
                continue
        _remove(path)
    for leftover in directory.glob(f"{TMP_PREFIX}*"):
        _remove(leftover)


def _corrupt(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is corrupt: {reason}; delete it to resume from an older one")


def _read_verified(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest and the raw file contents, every size and hash checked; nothing is deserialized but
    the JSON manifest."""
    try:
        raw = (path / MANIFEST_FILE).read_bytes()
    except OSError as err:
        raise _corrupt(path, f"cannot read {MANIFEST_FILE} ({err.strerror or err})") from err
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise _corrupt(path, f"{MANIFEST_FILE} is not valid JSON ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise _corrupt(path, f"{MANIFEST_FILE} is not a {FORMAT_NAME} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {manifest.get('format_version')!r}, this "
                              f"pipetransformer reads {FORMAT_VERSION}: resume with the version that wrote it")
    body = {key: value for key, value in manifest.items() if key != _MANIFEST_HASH_KEY}
    if manifest.get(_MANIFEST_HASH_KEY) != hashlib.sha256(_canonical(body)).hexdigest():
        raise _corrupt(path, f"{MANIFEST_FILE} does not match its own sha256")
    try:
        step, files, meta = int(manifest["step"]), manifest["files"], manifest["meta"]
        expected = {name: (int(files[name]["bytes"]), str(files[name]["sha256"]))
                    for name in (WEIGHTS_FILE, OPTIMIZER_FILE)}
    except (KeyError, TypeError, ValueError) as err:
        raise _corrupt(path, f"{MANIFEST_FILE} lacks a valid entry {err}") from err
    if not isinstance(meta, dict):
        raise _corrupt(path, f"{MANIFEST_FILE} has no metadata object")
    match = _STEP_DIR.fullmatch(path.name)
    if match and int(match.group(1)) != step:
        raise _corrupt(path, f"its manifest is for step {step}")
    payloads = {}
    for name, (size, digest) in expected.items():
        try:
            data = (path / name).read_bytes()
        except OSError as err:
            raise _corrupt(path, f"cannot read {name} ({err.strerror or err})") from err
        if len(data) != size:
            raise _corrupt(path, f"{name} has {len(data)} bytes, expected {size} (truncated?)")
        if hashlib.sha256(data).hexdigest() != digest:
            raise _corrupt(path, f"{name} does not match its sha256")
        payloads[name] = data
    return manifest, payloads
