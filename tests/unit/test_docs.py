"""The user docs agree with the code and stay user docs: the configuration reference lists every config field with
the code's default, every usage line parses and loads its config, the README starts with the two commands CI runs
and stays short, links resolve, and no user doc dates a measurement outside a results table."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from pipetransformer.cli import _parser, _plan_config
from pipetransformer.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIG_REFERENCE = DOCS / "configuration.md"
USER_DOCS = [README, *sorted(DOCS.glob("*.md"))]
ROW = re.compile(r"^\| `([a-z_]+(?:\.[a-z_]+)?)` \| `([^`]*)` \|", re.MULTILINE)


def _fields(instance: Any, prefix: str = "") -> dict[str, Any]:
    """Every field of the config dataclasses as ``section.key`` -> default, nested sections walked."""
    found: dict[str, Any] = {}
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if dataclasses.is_dataclass(value):
            found.update(_fields(value, f"{prefix}{field.name}."))
        else:
            found[f"{prefix}{field.name}"] = value
    return found


def test_config_reference_matches_the_code() -> None:
    documented = dict(ROW.findall(CONFIG_REFERENCE.read_text(encoding="utf-8")))
    defaults = _fields(Config())
    missing = sorted(set(defaults) - set(documented))
    assert not missing, f"docs/configuration.md lacks {missing}"
    stale = sorted(set(documented) - set(defaults))
    assert not stale, f"docs/configuration.md documents keys the config does not have: {stale}"
    wrong = {key: (documented[key], json.dumps(value)) for key, value in defaults.items()
             if json.loads(documented[key]) != value}
    assert not wrong, f"docs/configuration.md defaults differ from the code (docs, code): {wrong}"


COMMAND = re.compile(
    r"(?:^|\s)(?:\S*/)?pipetransformer(?:\.cli)?\s+(train|plan|replay|pretrain|report|predict|export)\b")

def _bash_blocks(doc: Path) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", doc.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)


def _doc_commands() -> list[list[str]]:
    """Every ``pipetransformer`` command in the user docs' bash blocks, as argv after the program name."""
    blocks = [block for doc in USER_DOCS for block in _bash_blocks(doc)]
    commands = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        for part in line.split("&&"):  # one line may chain commands (the README's first)
            match = COMMAND.search(part)
            if match:
                commands.append(shlex.split(part[match.start(1):], comments=True))
    return commands


def test_doc_commands_parse_and_their_configs_load() -> None:
    """A usage line that no longer matches the CLI or the config rules fails here, not in a user's shell."""
    commands = _doc_commands()
    assert len(commands) >= 10, f"expected the docs' usage lines, found {len(commands)}"
    for argv in commands:
        args = _parser().parse_args(argv)
        if getattr(args, "config", None) is not None:
            args.config = str(ROOT / args.config)  # the docs' paths are relative to the clone
        try:
            if args.command == "plan":
                _plan_config(args)
            elif getattr(args, "config", None) is not None:
                load_config(args.config, args.overrides)
        except ConfigError as error:
            raise AssertionError(f"docs: pipetransformer {shlex.join(argv)}: {error}") from error


CI_COMMANDS = (
    "bash scripts/setup.sh && .venv/bin/pipetransformer pretrain configs/vit_fashion.yaml --epochs 10 "
    "--out pretrained/vit_fashion_mim.safetensors --if-missing && "
    ".venv/bin/pipetransformer train configs/vit_fashion_all.yaml --nproc-per-node 2",
    "bash scripts/setup.sh && .venv/bin/python -m pytest -q",
)
"""The README's first two lines of code: what a new user runs, and what CI (``.ci/run``) runs."""
README_MAX_LINES = 250


def test_the_readme_starts_with_the_two_commands_ci_runs() -> None:
    text = README.read_text(encoding="utf-8")
    assert _bash_blocks(README)[0].splitlines() == list(CI_COMMANDS)
    assert text.index("```bash") < text.index("\n## "), "the two commands come before the README's first section"
    assert CI_COMMANDS[1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8"), ".ci/run runs the README's test command"


def test_the_readme_reads_in_five_minutes() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to docs/ (at most {README_MAX_LINES})"


DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b\d\d:\d\d UTC\b|today's VM|\bthe VM of\b|\b(?:January|February|March|"
                  r"April|June|July|August|September|October|November|December)\b|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|"
                  r"Sept|Oct|Nov|Dec)\.? \d")
"""A date, a time of day, or a machine named by its day: what belongs in CHANGELOG.md and benchmark LOG.md files."""


def _outside_results_tables(text: str) -> list[str]:
    """The lines that are neither a table row nor in the paragraph right above a table (its caption: date, machine)."""
    paragraphs = [p.splitlines() for p in re.split(r"\n\s*\n", text)]
    is_table = [bool(p) and all(line.startswith("|") for line in p) for p in paragraphs]
    return [line for i, paragraph in enumerate(paragraphs)
            if not is_table[i] and not (i + 1 < len(paragraphs) and is_table[i + 1]) for line in paragraph]


def test_no_user_doc_dates_a_measurement_outside_a_results_table() -> None:
    """A dated, machine-specific number ages in a day; beside its table it is the table's provenance."""
    found = [f"{doc.relative_to(ROOT)}: {line.strip()[:100]}" for doc in USER_DOCS
             for line in _outside_results_tables(doc.read_text(encoding="utf-8")) if DATE.search(line)]
    assert not found, "dates outside results tables (move them to CHANGELOG.md or a benchmark's LOG.md):\n" + \
        "\n".join(found)


def test_the_date_check_sees_dates_and_spares_table_captions() -> None:
    text = "Ran on the VM of 2026-11-27.\n\nCaption, 2026-11-27, 2 cores:\n\n| a | b |\n| --- | --- |\n| 1 | Nov 27 |\n"
    assert [line for line in _outside_results_tables(text) if DATE.search(line)] == ["Ran on the VM of 2026-11-27."]


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


BENCHMARK_DOCS = sorted([*(ROOT / "benchmarks").glob("*.md"), *(ROOT / "benchmarks").glob("*/*.md")])
"""Hand-written benchmark pages; the generated records under results/ keep their run directories' links."""


@pytest.mark.parametrize("doc", [*USER_DOCS, *BENCHMARK_DOCS],
                         ids=lambda doc: str(doc.relative_to(ROOT)))
def test_every_local_link_resolves(doc: Path) -> None:
    """Files moved (results into results/, notes into LOG.md or docs/) leave no dead link behind."""
    targets = [t for t in LINK.findall(doc.read_text(encoding="utf-8")) if "://" not in t and not t.startswith("mailto:")]
    dead = [t for t in targets if not (doc.parent / t).exists()]
    assert not dead, f"{doc.relative_to(ROOT)} links to missing files: {dead}"
