"""The GPU check's ``freeze_vit`` step works end to end here, on CPU, with the model shrunk: a GPU is lent to few
sessions and for minutes, so a step that crashes there wastes the loan. Real training runs in a child process (as the
check runs each step), plain and ``all`` taking turns; the schedule freezes, the cache serves, the ratio comes out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmark_scripts import BENCHMARKS, load_benchmark

TIMEOUT_S = 180
SMALL_VIT = "{image_size: 28, patch_size: 7, in_channels: 1, dim: 32, depth: 12, heads: 2, mlp_ratio: 2.0}"
"""ViT-B/16's 12 layers (the schedule freezes half of them) at a width two CPU cores train in seconds."""
RUN_STEP = f"""
import json, sys
from pathlib import Path
sys.path.insert(0, {str(BENCHMARKS.parent / "tests")!r})
from benchmark_scripts import load_benchmark
gpu = load_benchmark("gpu")
gpu.ONE_GPU = {{"dist.device=cpu", "dist.backend=auto"}}
gpu.VIT_B16 = gpu.Model("small-vit", tuple("model.vit={SMALL_VIT}" if o.startswith("model.vit=") else o
                                           for o in gpu.VIT_B16.overrides))
gpu.FREEZE_STEPS_PER_EPOCH = 12
gpu.BENCH_REPEATS = 1
out = Path(sys.argv[1])
(out / "result.json").write_text(json.dumps(gpu.step_freeze_vit(out), default=str))
"""


def test_the_freezing_step_trains_plain_and_frozen_and_reports_the_ratio(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", RUN_STEP, str(tmp_path)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["froze"], [run["freeze_outcome"] for run in result["runs"]["all"]]
    assert [len(result["runs"][name]) for name in ("plain", "all")] == [1, 1]
    plain, frozen = result["runs"]["plain"][0], result["runs"]["all"][0]
    assert len(plain["layout_history"]) == 1, "plain never changes its layout"
    assert frozen["layout_history"][-1]["cached_blocks"] > 0, "the frozen prefix is served from the cache"
    assert result["speedup"] == plain["wall_time_s"] / frozen["wall_time_s"] > 0
    gpu = load_benchmark("gpu")
    step = {"step": "freeze_vit", "what": "", "budget_s": 150, "status": "ok", "seconds": 1, "result": result}
    summary = gpu.markdown({"started": "now", "machine": "here", "steps": [step], "left_out": "nothing"})
    assert f"`all` {gpu._fmt(result['speedup'])}x plain" in summary and "froze as scheduled: True" in summary, summary
