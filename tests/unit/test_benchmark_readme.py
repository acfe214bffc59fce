"""The speed-up benchmark's outputs: file names that never overwrite another kind of run, and README blocks that
keep the hand-written history around them; every benchmark script answers --help without running."""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import ModuleType

import pytest
from benchmark_scripts import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def speedup() -> ModuleType:
    return load_benchmark("speedup")


def test_a_quick_run_a_subset_or_another_split_gets_its_own_files(speedup: ModuleType) -> None:
    family = list(speedup.FAMILY)

    def run(quick: bool, configs: list[str], split_seed: int | None = None) -> Namespace:
        return Namespace(quick=quick, configs=configs, split_seed=split_seed)

    assert speedup._stem("results", "text", run(False, family)) == "results-text"
    assert speedup._stem("results", "text", run(True, family)) == "quick-results-text"
    assert speedup._stem("report", "vit", run(False, ["all", "ddp", "single"])) == "report-vit-single-ddp-all"
    assert speedup._stem("results", "vit", run(False, ["all", "ddp"], 56)) == "results-vit-ddp-all-split56"


def test_a_fresh_split_of_the_vit_reads_its_test_rows_out_of_the_training_files(speedup: ModuleType,
                                                                                 tmp_path: Path) -> None:
    assert speedup._split_overrides("vit", None, tmp_path) == []
    assert speedup._split_overrides("text", 56, tmp_path) == ["data.split_seed=56"]
    name, path, seed = speedup._split_overrides("vit", 56, tmp_path)
    assert (name, seed) == ("data.name=image_folder", "data.split_seed=56")
    folder = Path(path.removeprefix("data.path="))
    assert sorted(p.name for p in folder.iterdir()) == ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"]


def test_a_block_is_replaced_and_the_text_around_it_kept(speedup: ModuleType, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    anchor = speedup.README_ANCHOR
    readme.write_text(f"# Benchmarks\n\nintro\n\n{anchor}\n\n### an earlier run, written by hand\n", encoding="utf-8")
    common = sys.modules["common"]
    common.replace_block(readme, "speedup/results-text", "first text run", anchor)
    common.replace_block(readme, "speedup/results-vit", "vit run", anchor)
    common.replace_block(readme, "speedup/results-text", "second text run", anchor)
    text = readme.read_text(encoding="utf-8")
    assert "first text run" not in text and text.count("second text run") == 1
    assert text.index("vit run") < text.index("second text run") < text.index("written by hand"), \
        "a new kind of run goes right under the anchor, newest first; a rerun stays where its block was"
    assert text.startswith("# Benchmarks\n\nintro\n\n") and text.endswith("### an earlier run, written by hand\n")


def test_a_readme_without_the_anchor_is_refused(speedup: ModuleType, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n", encoding="utf-8")
    with pytest.raises(ValueError, match="speedup:newest"):
        sys.modules["common"].replace_block(readme, "speedup/results-text", "a run", speedup.README_ANCHOR)
    assert readme.read_text(encoding="utf-8") == "# Benchmarks\n"


def test_the_benchmarks_readme_has_the_anchor(speedup: ModuleType) -> None:
    assert speedup.README_ANCHOR in (BENCHMARKS / "README.md").read_text(encoding="utf-8")


HELP_PROBE = """
import runpy, subprocess, sys

def refuse(*args, **kwargs):  # a script that starts its runs instead of printing usage stops here, having run nothing
    raise SystemExit(f"{sys.argv[0]} --help started a process instead of printing its usage")

subprocess.Popen = refuse
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise SystemExit(f"{script} --help exited {stop.code}")
        continue
    raise SystemExit(f"{script} --help ran instead of printing its usage")
"""


def test_every_benchmark_script_answers_help_without_running() -> None:
    """``--help`` (or a stray argument) must never start a benchmark that takes minutes and writes results."""
    scripts = sorted(str(path) for path in BENCHMARKS.glob("*/*.py"))
    assert len(scripts) >= 10
    done = subprocess.run([sys.executable, "-c", HELP_PROBE, *scripts], capture_output=True, text=True, timeout=300,
                          cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("usage:") == len(scripts), done.stdout[-2000:]
