"""Are two runs' records equal, timings aside? For refactors that must not change behaviour: run the same command
before and after the change, then ``python scripts/compare_runs.py BEFORE_DIR:AFTER_DIR [...]``.

Compares summary.json and test_samples.json (minus timings and paths), every metrics.jsonl record (likewise), the
samples each replica trained on, and the saved weights and optimizer state (run.save_model, checkpoints) by hash.
Exits 1 when anything differs, naming the first difference.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

DURATION_SUFFIX = "_s"
TIMING_MARKS = ("seconds", "wall", "time", "rss", "elapsed")
"""With :data:`DURATION_SUFFIX`: keys holding a duration, a rate or a process's memory, which differ between two runs
of the same code."""
UNCOMPARED_KEYS = {"run_dir", "path", "dir", "bytes", "cache_memory_bytes"}
"""Paths, a checkpoint's size (its manifest holds run.dir and timings) and the cache's occupancy (a snapshot of the
shared store while other ranks write to it: two runs of the same code differ)."""
JSON_FILES = ("summary.json", "test_samples.json")
HASHED = ("samples-rank*.jsonl", "*.safetensors", "checkpoints/*/*.safetensors")
HASH_CHARS = 16


def _compared(key: str) -> bool:
    timing = key.endswith(DURATION_SUFFIX) or any(mark in key for mark in TIMING_MARKS)
    return key not in UNCOMPARED_KEYS and not timing


def _strip(value: Any, left_out: set[str]) -> Any:
    """``value`` without the keys that are not compared, at any depth; their names are added to ``left_out``."""
    if isinstance(value, dict):
        left_out.update(key for key in value if not _compared(key))
        return {key: _strip(item, left_out) for key, item in value.items() if _compared(key)}
    if isinstance(value, list):
        return [_strip(item, left_out) for item in value]
    return value


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:HASH_CHARS]


def _records(run: Path, left_out: set[str]) -> list[Any]:
    return [_strip(json.loads(line), left_out) for line in (run / "metrics.jsonl").read_text().splitlines()]


def compare(before: Path, after: Path) -> bool:
    """Print each record's verdict; True when all are equal."""
    equal, left_out = True, set[str]()
    for name in JSON_FILES:
        if (before / name).exists():
            same = _strip(json.loads((before / name).read_text()), left_out) == _strip(
                json.loads((after / name).read_text()), left_out)
            equal &= same
            print(f"  {name}: {'equal' if same else 'DIFFERENT'}")
    old, new = _records(before, left_out), _records(after, left_out)
    equal &= old == new
    print(f"  metrics.jsonl: {len(old)} vs {len(new)} records: {'equal' if old == new else 'DIFFERENT'}")
    for index, (a, b) in enumerate(zip(old, new, strict=False)):
        if a != b:
            print(f"    first difference, record {index}:", {k: (a.get(k), b.get(k)) for k in {*a, *b}
                                                               if a.get(k) != b.get(k)})
            break
    for path in sorted(p for pattern in HASHED for p in before.glob(pattern)):
        relative = path.relative_to(before)
        same = (after / relative).exists() and _digest(path) == _digest(after / relative)
        equal &= same
        print(f"  {relative} sha256 {_digest(path)}: {'equal' if same else 'DIFFERENT'}")
    print(f"  left out: {', '.join(sorted(left_out))}")
    return equal


def main(pairs: list[str]) -> int:
    results = []
    for pair in pairs:
        before, after = pair.split(":")
        print(f"{before} vs {after}")
        results.append(compare(Path(before), Path(after)))
    print("all equal" if all(results) else "some differ")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
