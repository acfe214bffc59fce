"""The trainer reads the device only where a decision needs it: between those steps a step makes no host read, every
step's numbers still reach the freeze policy and the finite check in order, and reading less often changes nothing."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipetransformer.config import load_config
from pipetransformer.metrics import StepTimer
from pipetransformer.train import Trainer
from pipetransformer.train.control import TrainingDivergedError
from pipetransformer.train.optimizer import HeldOptimizer

ROOT = Path(__file__).resolve().parents[2]
HOST_READ = "aten._local_scalar_dense"
"""The op behind ``.item()``, ``float(t)``, ``int(t)`` and ``bool(t)``: a copy of one value to the host, which on a GPU
waits for every kernel queued before it."""
LOG_EVERY = 4
ALL = ("freeze.enabled=true", "freeze.descent_threshold=-1e9", "cache.enabled=true", "cache.min_frozen=1",
       "pipe.enabled=true", "pipe.micro_batches=auto", "dp.enabled=true")
"""Every automation on, nothing frozen (a descent threshold no t-statistic reaches): what a run pays until it freezes."""
DECIDING = ("_read_control", "_validate", "_checkpoint", "_finish")
"""Where the trainer may read the device: the ledger's read, an evaluation, a checkpoint, the end of the run."""
HOST_PHASE = "data"
"""The sampler and the data set are host tensors by design (the batch reaches the device after, without a wait)."""


class HostReads(TorchDispatchMode):
    """Host reads of one trainer's run outside its deciding methods and its data phase, by the step in progress."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__()
        self.trainer = trainer
        self.per_step: Counter[int] = Counter()
        self.exempt = 0  # > 0 inside a deciding method or the data phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func.overloadpacket) == HOST_READ and not self.exempt:
            self.per_step[self.trainer.progress.step + 1] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def exempted(self) -> Iterator[None]:
        self.exempt += 1
        try:
            yield
        finally:
            self.exempt -= 1


def _trainer(tmp_path: Path, config: str, *overrides: str) -> Trainer:
    return Trainer(load_config(ROOT / "configs" / config, [f"run.dir={tmp_path}", "checkpoint.enabled=false",
                                                           f"run.log_every={LOG_EVERY}", *overrides]))


def host_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str,
               *overrides: str) -> tuple[Counter[int], list[int], int]:
    """``(host reads per step outside decisions, the steps the ledger was read at, steps)`` of a run."""
    trainer = _trainer(tmp_path, config, *overrides)
    mode = HostReads(trainer)
    read_at: list[int] = []

    def exempting(name: str) -> Callable[..., Any]:
        original = getattr(Trainer, name)

        def wrapper(self: Trainer, *args: Any, **kwargs: Any) -> Any:
            if name == "_read_control" and len(self.ledger):
                read_at.append(self.progress.step)
            with mode.exempted():
                return original(self, *args, **kwargs)
        return wrapper

    for name in DECIDING:
        monkeypatch.setattr(Trainer, name, exempting(name))
    phase = StepTimer.phase

    @contextmanager
    def exempt_host_phase(self: StepTimer, name: str) -> Iterator[None]:
        with phase(self, name), (mode.exempted() if name == HOST_PHASE else nullcontext()):
            yield

    monkeypatch.setattr(StepTimer, "phase", exempt_host_phase)
    try:
        with mode:
            summary = trainer.fit()
    finally:
        trainer.close()
    return mode.per_step, read_at, summary["steps"]


def _reads_the_norm_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation the test must catch: a per-step ``float()`` of a device value (the clip's norm)."""
    step = HeldOptimizer.step

    def reading(self: HeldOptimizer, lr: float, total_grad_norm: torch.Tensor | float) -> None:
        float(total_grad_norm)
        step(self, lr, total_grad_norm)

    monkeypatch.setattr(HeldOptimizer, "step", reading)


@pytest.mark.parametrize("mutated", [False, True], ids=["as-built", "a-per-step-item"])
def test_between_decisions_a_step_of_all_reads_nothing_on_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    mutated: bool) -> None:
    """The tiny ViT with all four automations: 24 steps, read at the logged steps (1, 4, 8, ...), the freeze windows'
    ends (10, 20: the 10-step floor) and the epochs' (12, 24) only; every step, not one host read outside the data
    phase and those reads."""
    if mutated:
        _reads_the_norm_every_step(monkeypatch)
    per_step, read_at, steps = host_reads(tmp_path, monkeypatch, "tiny_vit.yaml", *ALL)
    assert steps == 24 and read_at == [1, 4, 8, 10, 12, 16, 20, 24], read_at
    if mutated:
        assert sum(per_step.values()) == steps, "the gate missed a per-step .item()"
    else:
        assert not per_step, f"host reads by step: {dict(per_step)}"


def test_a_split_text_model_builds_its_mask_once_a_forward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny BERT's only host read a step is its own: sdpa's look at the padding mask, once a forward as in the
    unsplit model, not once a layer (4 here)."""
    per_step, _, steps = host_reads(tmp_path, monkeypatch, "tiny_text.yaml", *ALL)
    assert per_step == Counter(dict.fromkeys(range(1, steps + 1), 1)), dict(per_step)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _fit(run_dir: Path, *overrides: str) -> tuple[Trainer, dict[str, Any]]:
    trainer = _trainer(run_dir, "tiny_vit.yaml", *overrides)
    try:
        return trainer, trainer.fit()
    finally:
        trainer.close()


FREEZES_ON_EVIDENCE = ("freeze.enabled=true", "freeze.interval_unit=steps", "freeze.interval=3",
                       "freeze.descent_threshold=1e9", "freeze.jitter_max_share=null", "train.epochs=3")
"""The descent policy in 3-step windows with a threshold every layer passes: it freezes from the statistics as soon
as its test may (3 of 6 layers at step 9, the evidence cap), and each of its 12 windows records its t-statistics, so a
statistic observed late, twice or not at all would show."""


def test_reading_every_step_or_every_fifth_trains_the_same_model(tmp_path: Path) -> None:
    every, every_summary = _fit(tmp_path / "every", *FREEZES_ON_EVIDENCE, "run.log_every=1")
    fifth, fifth_summary = _fit(tmp_path / "fifth", *FREEZES_ON_EVIDENCE, "run.log_every=5")
    decisions = every_summary["freeze_decisions"]  # with each window's t-statistics, to the last bit
    assert decisions and decisions[0]["descent_t"] and decisions == fifth_summary["freeze_decisions"]
    windows = [r for r in _metrics(tmp_path / "every") if r["event"] == "freeze_window"]
    assert windows == [r for r in _metrics(tmp_path / "fifth") if r["event"] == "freeze_window"]
    for (name, tensor), other in zip(every.model.state_dict().items(), fifth.model.state_dict().values(), strict=True):
        assert torch.equal(tensor, other), f"{name} differs when the device is read less often"
    logged = {r["step"]: r["loss"] for r in _metrics(tmp_path / "fifth") if r["event"] == "step"}
    assert logged and all(r["loss"] == logged[r["step"]] for r in _metrics(tmp_path / "every")
                          if r["event"] == "step" and r["step"] in logged)


def test_a_non_finite_step_found_at_a_later_read_is_named_and_nothing_after_it_is_saved(tmp_path: Path) -> None:
    with pytest.raises(TrainingDivergedError) as raised:
        _fit(tmp_path, "train.lr=1.0e+12", "train.grad_clip=null", "train.warmup_fraction=0.0", "run.log_every=5")
    found = re.search(r"at step (\d+), .*\(read at step (\d+)\); nothing after step (\d+) was saved", str(raised.value))
    assert found, str(raised.value)
    bad, read, saved = map(int, found.groups())
    assert 1 < bad <= read and read % 5 == 0 and saved == bad - 1, str(raised.value)


WARM_UP_STEPS = 2
"""Steps that make the device's cached constants (the statistics' indices, the valid flags): one copy each, once."""


@pytest.mark.cuda(devices=1)
def test_on_cuda_a_step_of_all_never_waits_for_the_gpu_between_decisions(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.set_sync_debug_mode`` flags every synchronising call (``.item()``, a blocking copy, a
    synchronize); after the warm-up, none outside the deciding methods, the data phase and a logged step's timer."""
    import warnings

    trainer = _trainer(tmp_path, "tiny_vit.yaml", *ALL, "dist.device=cuda")
    syncs: list[int] = []
    exempt = [0]

    def exempting(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            exempt[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                exempt[0] -= 1
        return wrapper

    for name in DECIDING:
        monkeypatch.setattr(Trainer, name, exempting(getattr(Trainer, name)))
    phase = StepTimer.phase

    @contextmanager
    def exempt_timed(self: StepTimer, name: str) -> Iterator[None]:
        exempted = int(name == HOST_PHASE or self.synchronize)  # a logged step's timer synchronizes to be honest
        exempt[0] += exempted
        try:
            with phase(self, name):
                yield
        finally:
            exempt[0] -= exempted

    monkeypatch.setattr(StepTimer, "phase", exempt_timed)

    def record(message: Any, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" in str(message) and not exempt[0] and trainer.progress.step >= WARM_UP_STEPS:
            syncs.append(trainer.progress.step)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            monkeypatch.setattr(warnings, "showwarning", record)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.fit()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        trainer.close()
    assert not syncs, f"host syncs at steps {Counter(syncs)}"
