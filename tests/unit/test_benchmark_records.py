"""The freeze-transfer benchmark's recorded results are what its scoring code makes of their own runs.

Every reported table, paired difference and gate verdict is computed from the runs a results*.json records. A
change to that code that moves a recorded number fails here, so it cannot land silently: rescore the files
(``benchmarks/freeze_transfer/main.py --rescore FILE``), read what moved, and commit them with the change.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from benchmark_scripts import BENCHMARKS, load_benchmark

BENCHMARK_DIR = BENCHMARKS / "freeze_transfer"
RECORDS = sorted((BENCHMARK_DIR / "results").glob("results*.json"))
RESCORE_HINT = "rescore it with benchmarks/freeze_transfer/main.py --rescore and commit what moved"


@pytest.fixture(scope="module")
def benchmark() -> ModuleType:
    return load_benchmark("freeze_transfer")


def test_there_are_records(benchmark: ModuleType) -> None:
    assert len(RECORDS) >= 3, f"expected the recorded full runs in {BENCHMARK_DIR / 'results'}"
    assert benchmark.RESULTS == RECORDS[0].parent, "the benchmark writes its records where this test reads them"


@pytest.mark.parametrize("record", RECORDS, ids=[path.stem for path in RECORDS])
def test_a_record_is_its_runs_scored_today(benchmark: ModuleType, record: Path) -> None:
    markdown, payload = benchmark.rescored(record)
    assert markdown.rstrip() + "\n" == record.with_suffix(".md").read_text(encoding="utf-8"), \
        f"{record.with_suffix('.md').name} is not its runs scored by today's code: {RESCORE_HINT}"
    recorded = json.loads(record.read_text())
    for task, entry in payload["tasks"].items():
        table = json.loads(json.dumps(entry["table"], default=str))
        assert table == recorded["tasks"][task]["table"], f"{record.name} {task}: {RESCORE_HINT}"


@pytest.mark.parametrize("mode", ["full", "quick"])
def test_the_benchmarks_readme_shows_the_newest_record(benchmark: ModuleType, mode: str) -> None:
    stem = benchmark._stem(mode)
    markdown = (benchmark.RESULTS / f"{stem}.md").read_text(encoding="utf-8")
    section = (BENCHMARKS / "README.md").read_text(encoding="utf-8").split(
        f"<!-- freeze_transfer-{mode}:start -->\n", 1)[1].split(f"\n<!-- freeze_transfer-{mode}:end -->", 1)[0]
    assert section + "\n" == markdown.replace("# Freeze", "## Freeze", 1), \
        f"benchmarks/README.md's freeze_transfer-{mode} section is not {stem}.md: {RESCORE_HINT}"
