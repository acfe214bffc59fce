"""Command line: ``pipetransformer train | plan | report | replay | pretrain | predict | export``.

One device::

    pipetransformer train configs/text_minilm.yaml

Two local workers (started here through torch.distributed.run)::

    pipetransformer train configs/text_minilm.yaml --nproc-per-node 2

Two nodes, one worker each (the same command on both; this process joins the outer job)::

    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint $MASTER_ADDR:29500 -m pipetransformer.cli train configs/text_minilm.yaml
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path

from pipetransformer.config import RESUME_AUTO, Config, ConfigError, load_config

__all__ = ["main"]

EXIT_USER_ERROR = 2
EXIT_WORKER_FAILED = 1
EXIT_INTERRUPTED = 128 + signal.SIGINT
"""What a shell reports for a command stopped by Ctrl-C (130), also after the checkpoint at the interrupt."""
STOPPED_HARD = "stopped by a second Ctrl-C: --resume continues from the newest checkpoint written before it"
INTERRUPTED_OUTSIDE_TRAINING = ("interrupted before the first training step or after the last: no checkpoint was "
                                "written at the interrupt")
LOOPBACK = "127.0.0.1"
SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
ERROR_DIR_ENV = "PIPETRANSFORMER_ERROR_DIR"
"""Set for local workers: each writes its one-line user error here, so the launcher can repeat it last."""
OMP_THREADS_ENV = "OMP_NUM_THREADS"
"""Set for local workers to the threads each uses anyway; torchrun prints a banner when it sets this itself."""
HF_CONFIG_FILE = "config.json"
AGENT_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT"
"""torchrun's agent answers the signals it handles by signalling the workers and SIGKILLing them 30 s later; SIGINT
is left out so the launcher handles Ctrl-C itself and the workers have the time their checkpoint takes."""
WEIGHT_CHOICES = ("final", "best")
"""``predict``/``export --weights``: model.safetensors or best-validation.safetensors of the run."""
DEFAULT_NEW_TOKENS = 64
"""``predict --max-new-tokens``: the tokens (the built-in decoder's are bytes) a greedy continuation may take."""
TORCHRUN_LOG_DIR = "torchrun"
PID_FILE_PREFIX = "pid-rank"
"""+ rank: each local worker writes its process id into the error directory, for the launcher to forward Ctrl-C."""


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipetransformer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model from a YAML config")
    train.add_argument("config", help="YAML config (see configs/)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.lr=1e-4 (repeatable)")
    train.add_argument("--nproc-per-node", type=int, default=1,
                       help="local workers to start (ignored under an outer torchrun)")
    train.add_argument("--max-restarts", type=int, default=0,
                       help="restarts after a worker failure; each resumes from the newest valid checkpoint")
    train.add_argument("--resume", nargs="?", const=RESUME_AUTO, default=None, metavar=f"PATH|{RESUME_AUTO}",
                       help="continue from a checkpoint directory, or the newest valid one in the run (auto)")
    plan = commands.add_parser("plan", help="print block costs, the partition and the predicted step time; "
                                            "with --cluster, a whole run predicted on a cluster")
    plan.add_argument("config", nargs="?", default=None,
                      help="YAML config (optional with --cluster and --model: defaults, all automations on)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--nproc-per-node", type=int, default=1,
                      help="workers to plan for on this machine (also --cluster local; a preset has its own)")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--cluster", default=None, metavar="PRESET|FILE",
                      help="predict a run on paper (2x8 RTX 5000), a100x8, h100x8, local (profiled here), "
                           "or a YAML/JSON cluster file")
    plan.add_argument("--model", default=None, metavar="NAME|CONFIG",
                      help="vit-b16, vit-l16, bert-base, bert-large, minilm, or a Hugging Face config.json "
                           "(default: the config's model)")
    plan.add_argument("--seq-len", type=int, default=None, help="tokens per sample of a text --model")
    plan.add_argument("--freeze", default="geometric", metavar="geometric|RUN",
                      help="freeze timeline: the geometric schedule (freeze.alpha, freeze.max_fraction) or a "
                           "finished run's directory or summary.json")
    plan.add_argument("--epochs", type=float, default=None, help="epochs of the run (default: train.epochs)")
    plan.add_argument("--freeze-every", type=float, default=None, metavar="EPOCHS",
                      help="epochs between geometric freeze decisions (default: freeze.interval)")
    plan.add_argument("--levers", default="stages,recompute,bf16",
                      help="what may make the model fit: any of stages, recompute, bf16 (comma-separated)")
    plan.add_argument("--baseline-stages", type=int, default=None,
                      help="stages of the static Pipe+DDP baseline (default: the fastest that fits)")
    plan.add_argument("--baseline-micro-batches", type=int, default=None,
                      help="micro-batches of the baseline (default: pipe.micro_batches)")
    plan.add_argument("--plot", default=None, metavar="PNG", help="also plot predicted samples/s through the run")
    plan.add_argument("--timeline", action="store_true", help="also draw each phase's simulated step")
    report = commands.add_parser("report", help="plots and a markdown summary from run directories")
    report.add_argument("run_dirs", nargs="+")
    report.add_argument("--out", default=None, help="output directory (default: the first run directory)")
    replay = commands.add_parser("replay", help="the freeze decisions a policy takes on a run's logged gradient norms")
    replay.add_argument("run_dir", help="a run that froze nothing, trained with run.log_every=1")
    replay.add_argument("--config", default=None,
                        help="take the freeze settings from this YAML config (default: the run's own)")
    replay.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a freeze setting, e.g. --set freeze.max_change=0.1 (repeatable)")
    pretrain = commands.add_parser("pretrain", help="masked-patch pretraining of a config's ViT on its training images")
    pretrain.add_argument("config", help="a YAML config with model.kind: vit")
    pretrain.add_argument("--out", required=True, help="backbone file to write (use it as model.path)")
    pretrain.add_argument("--epochs", type=int, default=None, help="passes over the images (default: train.epochs)")
    pretrain.add_argument("--if-missing", action="store_true",
                          help="do nothing when --out already exists (a command that sets up once, then reuses it)")
    pretrain.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    predict = commands.add_parser("predict",
                                  help="a trained run's predictions for a CSV of texts or a folder of images; a "
                                       "language model's continuations of a CSV's prompts")
    predict.add_argument("run_dir", help="a run directory that training wrote (config.yaml, summary.json, weights)")
    predict.add_argument("--input", required=True, help="a CSV with the run's data.text_column, or a folder of images")
    predict.add_argument("--output", default=None, help="CSV to write (default: RUN_DIR/predictions.csv)")
    predict.add_argument("--weights", choices=WEIGHT_CHOICES, default="final",
                         help="the final weights, or those of the best validation")
    predict.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                         help="a language model's run: the most tokens (bytes for the built-in decoder) each "
                              "continuation takes (greedy)")
    export = commands.add_parser("export", help="a trained run as a directory transformers loads (a classifier with "
                                                 "its trained head; a decoder as GPT-2)")
    export.add_argument("run_dir")
    export.add_argument("out", help="directory to write (AutoModel.from_pretrained loads it)")
    export.add_argument("--weights", choices=WEIGHT_CHOICES, default="final")
    return parser


def _world_size(args: argparse.Namespace) -> int:
    return int(os.environ["WORLD_SIZE"]) if _under_torchrun() else args.nproc_per_node


def _check_stage_count(stages: int, world_size: int) -> None:
    from pipetransformer.pipe.layout import LayoutError, check_stage_count

    try:
        check_stage_count(stages, world_size)
    except LayoutError as error:  # a mistake in the config itself: reported as one, before torch is imported
        raise ConfigError(str(error)) from None


def _check_before_launch(config: Config, world_size: int) -> None:
    """Mistakes visible without a model: caught before any worker starts or the run directory is touched."""
    if world_size < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {world_size}")
    if config.pipe.enabled and isinstance(config.pipe.stages, int):
        _check_stage_count(config.pipe.stages, world_size)
    if config.model.kind in ("hf", "hf_decoder") and config.model.path \
            and not (Path(config.model.path) / HF_CONFIG_FILE).is_file():
        raise ConfigError(f"model.path={config.model.path} holds no Hugging Face model (no {HF_CONFIG_FILE}): "
                          "point it at a local directory saved with save_pretrained")
    if config.model.kind == "decoder" and config.model.path and not Path(config.model.path).is_file():
        raise ConfigError(f"model.path={config.model.path} does not exist: give an earlier decoder run's "
                          "model.safetensors, or remove model.path to start from random weights")
    if config.model.kind == "vit" and config.model.path and not Path(config.model.path).is_file():
        raise ConfigError(f"model.path={config.model.path} does not exist: create a ViT backbone with "
                          f"`pipetransformer pretrain CONFIG --out {config.model.path}` or remove model.path")
    if config.data.path and not Path(config.data.path).exists():
        raise ConfigError(f"data.path={config.data.path} does not exist: point it at your "
                          f"{'CSV file' if config.data.name == 'text_csv' else 'data folder'}")


def _worker_error(error_dir: Path) -> str | None:
    """The lowest rank's user error, if a worker wrote one."""
    messages = sorted(error_dir.glob("rank*.txt"), key=lambda p: int(p.stem.removeprefix("rank")))
    return messages[0].read_text().strip() if messages else None


class _LauncherInterrupts:
    """Ctrl-C at the launcher. The first is forwarded to every worker as SIGINT (a `kill -INT` reaches the launcher
    alone; a terminal's Ctrl-C reaches the workers too, and a second copy only repeats the request): they checkpoint
    at the next step and stop. A second stops them at once (SIGKILL), keeping only the checkpoints already written."""

    def __init__(self, error_dir: Path) -> None:
        self.error_dir, self.count = error_dir, 0

    def __call__(self, signum: int, frame: object) -> None:
        self.count += 1
        forwarded = signal.SIGINT if self.count == 1 else signal.SIGKILL
        for pid_file in self.error_dir.glob(f"{PID_FILE_PREFIX}*"):
            try:
                os.kill(int(pid_file.read_text()), forwarded)
            except (ProcessLookupError, ValueError):  # that worker has already exited, or is writing its id
                continue


def _launch_local(args: argparse.Namespace, overrides: list[str], threads: int, run_dir: Path) -> int:
    """Start ``--nproc-per-node`` workers of ``threads`` torch threads each through torch.distributed.run on this
    machine (loopback only)."""
    from torch.distributed.run import get_args_parser, run

    # Workers restarted by torchrun (and agents joining later) hang in rendezvous when they share the agent's
    # TCP store; a store of their own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) lets them join.
    os.environ.setdefault(SHARED_STORE_ENV, "1")
    os.environ.setdefault(OMP_THREADS_ENV, str(threads))
    with tempfile.TemporaryDirectory(prefix="pipetransformer-errors-") as error_dir:
        launcher_args = get_args_parser().parse_args([
            "--standalone", "--nproc-per-node", str(args.nproc_per_node), "--max-restarts", str(args.max_restarts),
            "--local-addr", LOOPBACK, "--signals-to-handle", AGENT_SIGNALS,
            # torchrun's per-attempt folders (empty: nothing is redirected) go with this directory, not into /tmp
            "--log-dir", str(Path(error_dir) / TORCHRUN_LOG_DIR),
            "--module", "pipetransformer.cli", "train", args.config,
            *[item for override in overrides for item in ("--set", override)],
        ])
        os.environ[ERROR_DIR_ENV] = error_dir
        interrupts = _LauncherInterrupts(Path(error_dir))
        previous = signal.signal(signal.SIGINT, interrupts)
        try:
            run(launcher_args)
        except Exception as error:  # torch's ChildFailedError
            message = _worker_error(Path(error_dir))
            if message is not None:
                print(f"error: {message}", file=sys.stderr)
                return EXIT_USER_ERROR
            if interrupts.count:
                print(f"error: {INTERRUPTED_OUTSIDE_TRAINING if interrupts.count == 1 else STOPPED_HARD}",
                      file=sys.stderr)
                return EXIT_INTERRUPTED
            print(f"error: {_describe_failures(error)}; the workers' messages are above", file=sys.stderr)
            return EXIT_WORKER_FAILED
        finally:
            signal.signal(signal.SIGINT, previous)
            del os.environ[ERROR_DIR_ENV]
    return _report_interruption(_read_interruption(run_dir), args, run_dir)


def _read_interruption(run_dir: Path) -> dict[str, object] | None:
    """The run's record of a stop by a signal (``interrupted`` in ``summary.json``), if it has one."""
    from pipetransformer.train.recorder import SUMMARY_FILE

    path = run_dir / SUMMARY_FILE
    return json.loads(path.read_text()).get("interrupted") if path.is_file() else None


def _resume_command(args: argparse.Namespace, run_dir: Path) -> str:
    """The command that continues this run from its newest checkpoint: the same one, in its run directory."""
    parts = ["pipetransformer", "train", args.config]
    if args.nproc_per_node != 1:
        parts += ["--nproc-per-node", str(args.nproc_per_node)]
    for override in args.overrides:
        if not override.startswith(("run.dir=", "checkpoint.resume=")):
            parts += ["--set", override]
    return shlex.join([*parts, "--set", f"run.dir={run_dir}", "--resume"])


def _report_interruption(interrupted: dict[str, object] | None, args: argparse.Namespace, run_dir: Path) -> int:
    """One line for a run stopped by Ctrl-C and :data:`EXIT_INTERRUPTED`; 0 for any other end (SIGTERM included:
    a scheduler's stop, which a restart resumes)."""
    if interrupted is None or interrupted.get("signal") != signal.SIGINT.name:
        return 0
    step = interrupted.get("step")
    if interrupted.get("checkpoint") is None:
        print(f"interrupted at step {step}; checkpoint.enabled is false, so there is nothing to continue from",
              file=sys.stderr)
    else:
        print(f"interrupted at step {step}; continue with: {_resume_command(args, run_dir)}", file=sys.stderr)
    return EXIT_INTERRUPTED


def _describe_failures(error: Exception) -> str:
    """Which workers failed and how. torchrun answers one failure by SIGTERMing the rest; naming those
    too would hide the one that died (a SIGKILL from the OOM killer reads differently from an exception)."""
    failures = getattr(error, "failures", None)  # ChildFailedError: global rank -> ProcessFailure
    if not failures:
        return f"training failed ({error.__class__.__name__})"
    causes = {rank: f for rank, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    described = [f"rank {rank} " + (f"killed by {failure.signal_name()}" if failure.exitcode < 0
                                    else f"exited with code {failure.exitcode}")
                 for rank, failure in sorted(causes.items())]
    return "training failed: worker " + ", ".join(described)


def _check_in_a_child_process(config: Config, world_size: int) -> None:
    """:func:`~pipetransformer.plan.command.check_before_workers` in a short-lived process, which raises its errors
    here: the model it loads leaves with it, where this launcher, waiting out the whole run, would keep the
    allocator's share of it (~140 MB of MiniLM's 90 MB of weights and their profile).

    Forked, so the child starts with torch imported (a spawned one spent ~3.5 s of a 2-core VM importing it again).
    Safe here: the launcher has run no torch op and never touches a GPU, so no thread pool or CUDA context is
    copied half-made; where fork does not exist the child is spawned."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from pipetransformer.plan.command import check_before_workers

    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context(method)) as child:
        child.submit(check_before_workers, config, world_size).result()


def _train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.resume is not None or args.max_restarts > 0:
        overrides.append(f"checkpoint.resume={args.resume or RESUME_AUTO}")
    config = load_config(args.config, overrides)  # validate before any worker starts
    _check_before_launch(config, _world_size(args))
    if config.checkpoint.resume not in (None, RESUME_AUTO) and not _under_torchrun():
        # under an outer torchrun only rank 0's node need see the checkpoint: rank 0 reads it and hands it on
        from pipetransformer.checkpoint import check_is_a_checkpoint

        check_is_a_checkpoint(Path(config.checkpoint.resume))
    if config.run.dir is None:
        overrides.append(f"run.dir={config.run.resolved_dir()}")
    if args.nproc_per_node > 1 and not _under_torchrun():
        from pipetransformer.distributed import worker_threads

        _check_in_a_child_process(config, args.nproc_per_node)
        run_dir = Path(load_config(args.config, overrides).run.dir or "")
        return _launch_local(args, overrides, worker_threads(config.dist, args.nproc_per_node), run_dir)
    from pipetransformer.train import train
    from pipetransformer.train.task import task_for
    config = load_config(args.config, overrides)
    summary = train(config)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    metric = task_for(config.model.kind).metric
    shown = (f"eval_{metric}", f"best_eval_{metric}", f"test_{metric}", f"test_{metric}_at_best_validation",
             "wall_time_s", "samples_per_s", "freeze_outcome", "interrupted", "run_dir")
    print(json.dumps({k: summary.get(k) for k in shown if k in summary or k != "interrupted"}, indent=2))
    if ERROR_DIR_ENV in os.environ:  # a local worker: its launcher reports the interruption and exits 130
        return 0
    code = _report_interruption(summary.get("interrupted"), args, Path(summary["run_dir"]))
    return 0 if _under_torchrun() else code  # a torchrun worker's 130 would read as a failure, even a restart


PLAN_DEFAULTS = ["freeze.enabled=true", "pipe.enabled=true", "dp.enabled=true", "cache.enabled=true"]
"""``plan --cluster --model`` without a config predicts PipeTransformer with all four automations on."""


def _plan_config(args: argparse.Namespace) -> Config:
    """The config ``plan`` reads: the given one, or without one (``--cluster`` with ``--model``) the defaults with
    all four automations on."""
    if args.cluster is None or args.cluster == "local" or args.model is None:
        if args.config is None:
            raise ConfigError("plan needs a config (or --cluster PRESET|FILE with --model NAME|CONFIG)")
    return load_config(args.config, args.overrides if args.config else [*PLAN_DEFAULTS, *args.overrides])


def _plan(args: argparse.Namespace) -> int:
    from pipetransformer.plan.command import ClusterPlanRequest, cluster_plan_command, plan_command
    config = _plan_config(args)
    if args.cluster is None:
        _check_before_launch(config, args.nproc_per_node)
        return plan_command(config, args.nproc_per_node, as_json=args.json)
    if args.cluster == "local":
        _check_before_launch(config, args.nproc_per_node)
    request = ClusterPlanRequest(
        cluster=args.cluster, model=args.model, seq_len=args.seq_len, freeze=args.freeze, epochs=args.epochs,
        freeze_every=args.freeze_every, levers=tuple(name.strip() for name in args.levers.split(",") if name.strip()),
        baseline_stages=args.baseline_stages, baseline_micro_batches=args.baseline_micro_batches, plot=args.plot,
        timeline=args.timeline)
    return cluster_plan_command(config, request, args.nproc_per_node, as_json=args.json)


def _report(args: argparse.Namespace) -> int:
    from pipetransformer.report import write_report
    out = write_report([Path(d) for d in args.run_dirs], Path(args.out) if args.out else None)
    print(f"report written to {out}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from pipetransformer.freeze.policies import policy_from_settings, resolve_prior
    from pipetransformer.freeze.replay import read_logged_steps, replay
    from pipetransformer.optim import lr_at
    run_dir = Path(args.run_dir)
    run_config = run_dir / "config.yaml"
    if run_config.is_file() and (logged_every := load_config(run_config).run.log_every) != 1:
        raise ConfigError(f"{run_dir} was trained with run.log_every={logged_every}: replay needs every step's "
                          "gradient statistics; train the run with --set run.log_every=1")
    steps = read_logged_steps(run_dir / "metrics.jsonl")
    config = load_config(args.config or run_config, args.overrides)
    f, layers = config.freeze, len(steps[0].layer_grad_norms)
    try:  # the replayed run's learning-rate schedule, as the trainer builds it
        prior = resolve_prior(f.prior, layers, pretrained=config.model.pretrained)
        policy = policy_from_settings(f, layers, seed=config.seed, total_steps=len(steps), prior_layers=prior.layers,
                                      learning_rates=[lr_at(step, len(steps), config.train) for step in range(len(steps))])
    except ValueError as error:
        raise ConfigError(str(error)) from None
    read = {"descent": ("descent_threshold", "max_advance", "evidence_max_fraction", "early_max_fraction",
                        "jitter_max_share"),
            "coherence": ("threshold", "max_advance", "learned_by", "learned_min_steps", "evidence_max_fraction"),
            "gradient": ("percentile", "max_change", "evidence_max_fraction"),
            "geometric": ("alpha",), "random": ("alpha",), "schedule": ("schedule",)}.get(f.policy, ())
    settings = " ".join(f"{name}={getattr(f, name)}" for name in read)  # the settings this policy reads
    print(f"freeze.policy={f.policy} prior={f.prior} interval={f.interval} {f.interval_unit} {settings} "
          f"max_fraction={f.max_fraction} over {len(steps)} steps of {run_dir}".replace("  ", " "))
    try:
        decisions = replay(policy, steps)
    except ValueError as error:  # e.g. the policy needs signals the run did not log
        raise ConfigError(str(error)) from None
    for decision in decisions:
        print(f"step {decision.step} (epoch {decision.epoch}): {len(decision.frozen)} layers frozen "
              f"{sorted(decision.frozen)}")
    if not decisions:
        print(policy.outcome())
    return 0


def _pretrain(args: argparse.Namespace) -> int:
    if args.if_missing and Path(args.out).is_file():
        print(f"{args.out} exists: kept (--if-missing)")
        return 0
    config = load_config(args.config, args.overrides)
    if config.model.kind != "vit":
        raise ConfigError(f"pretrain needs model.kind: vit (masked-patch pretraining of the built-in ViT), "
                          f"not {config.model.kind}")
    epochs = config.train.epochs if args.epochs is None else args.epochs
    if epochs < 1:
        raise ConfigError(f"--epochs must be >= 1, got {epochs}")
    _check_before_launch(config, world_size=1)
    import torch

    from pipetransformer.data import datasets_from_config
    from pipetransformer.distributed import resolve_device
    from pipetransformer.models import build_model
    from pipetransformer.models.pretrain import masked_patch_pretrain
    from pipetransformer.models.vit import save_vit_backbone, vit_image_shape
    device = resolve_device(config.dist)
    torch.manual_seed(config.seed)
    image_shape = vit_image_shape(config.model.vit)
    train_set = datasets_from_config(config.data, tokenizer=None, image_shape=image_shape).train  # no held-out images
    pixels = train_set.get_batch(list(range(len(train_set)))).inputs[0]
    try:
        model = build_model("vit", num_labels=train_set.num_classes, path=config.model.path,
                            vit=dict(config.model.vit)).to(device)
        masked_patch_pretrain(model, pixels, config.train, epochs=epochs, seed=config.seed,
                              on_epoch=lambda epoch, loss, seconds: print(
                                  f"epoch {epoch + 1}/{epochs}: masked-patch loss {loss:.4f} ({seconds:.0f} s)",
                                  flush=True))
    except ValueError as error:  # the messages name the setting to change
        raise ConfigError(str(error)) from None
    save_vit_backbone(model.cpu(), Path(args.out))
    print(f"backbone written to {args.out}: set model.path: {args.out}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from pipetransformer.predict import predict_command
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    return predict_command(Path(args.run_dir), Path(args.input), Path(args.output) if args.output else None,
                           args.weights, args.max_new_tokens)


def _export(args: argparse.Namespace) -> int:
    from pipetransformer.export import export_command
    return export_command(Path(args.run_dir), Path(args.out), args.weights)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message already says what to change: shown as one line, without a traceback."""
    from pipetransformer.checkpoint import CheckpointError
    from pipetransformer.data.batch import DatasetUnavailableError
    from pipetransformer.freeze.replay import ReplayError
    from pipetransformer.models.blocks import BlockSplitError
    from pipetransformer.pipe.layout import LayoutError
    from pipetransformer.pipe.partition import PartitionError
    from pipetransformer.plan.cluster import ClusterError
    from pipetransformer.plan.model_spec import ModelSpecError
    from pipetransformer.plan.runplan import TimelineError
    from pipetransformer.train import TrainingDivergedError
    return (CheckpointError, TrainingDivergedError, ConfigError, DatasetUnavailableError, BlockSplitError, LayoutError,
            PartitionError, ReplayError, ClusterError, ModelSpecError, TimelineError, FileNotFoundError)


def _report_user_error(error: BaseException) -> None:
    """One line on stderr; a local worker hands it to its launcher, which prints it last."""
    message = " ".join(str(error).splitlines())
    error_dir = os.environ.get(ERROR_DIR_ENV)
    rank = int(os.environ.get("RANK", "0"))
    if error_dir and _under_torchrun():
        (Path(error_dir) / f"rank{rank}.txt").write_text(message)
    elif rank == 0 or isinstance(error, ConfigError):
        print(f"error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = _parser().parse_args(argv)
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir and _under_torchrun():  # a local worker: the launcher forwards Ctrl-C to this id
        (Path(error_dir) / f"{PID_FILE_PREFIX}{os.environ['RANK']}").write_text(str(os.getpid()))
    handlers = {"train": _train, "plan": _plan, "report": _report, "replay": _replay, "pretrain": _pretrain,
                "predict": _predict, "export": _export}
    try:
        return handlers[args.command](args)
    except ConfigError as error:  # first, so a typo is reported without importing torch
        _report_user_error(error)
        return EXIT_USER_ERROR
    except _user_errors() as error:
        _report_user_error(error)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # outside the training loop, or a lone process's second Ctrl-C
        if int(os.environ.get("RANK", "0")) == 0 and ERROR_DIR_ENV not in os.environ:
            print(f"error: {INTERRUPTED_OUTSIDE_TRAINING}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
