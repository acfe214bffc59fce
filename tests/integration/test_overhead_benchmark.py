"""The overhead benchmark's one-process mode, which the GPU check's ``overhead_vit`` step runs on one GPU, works
here on CPU: real training runs, its section and results in the given folder, this repository's README untouched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmark_scripts import BENCHMARKS

SCRIPT = BENCHMARKS / "overhead" / "main.py"
TIMEOUT_S = 300


def test_one_process_writes_its_round_into_the_out_folder(tmp_path: Path) -> None:
    readme = (SCRIPT.parent / "README.md").read_text()
    done = subprocess.run([sys.executable, str(SCRIPT), "--one-process", "--quick", "--variants", "freeze",
                           "--repeats", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "results-vit-one-process-freeze.json").read_text())
    assert results["nproc"] == 1 and set(results["vs_plain"]) == {"plain", "freeze"}
    assert [len(results["runs"][name]) for name in ("plain", "freeze")] == [2, 2]
    section = (tmp_path / "overhead-vit-one-process-freeze.md").read_text()
    assert section.startswith("## vit in one process: `freeze` against plain"), section.splitlines()[0]
    assert "1 stage x 1 replica in one process" in section and "--one-process" in section
    assert (SCRIPT.parent / "README.md").read_text() == readme, "an --out round must not touch the README"
