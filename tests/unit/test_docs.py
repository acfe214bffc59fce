"""The README agrees with the code: its config reference lists every key with the code's default, and its usage
lines parse and load their configs, so the two cannot drift apart."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from pipetransformer.cli import _parser, _plan_config
from pipetransformer.config import Config, ConfigError, config_to_dict, load_config

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^\| `([a-z_]+(?:\.[a-z_]+)?)` \| `([^`]*)` \|", re.MULTILINE)
FREE_FORM = ("model.vit", "model.hf_config")
"""Keyword dicts passed through to a model builder: documented by their row, not by a default value."""


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in FREE_FORM:
            flat.update(_flat(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def test_config_reference_matches_the_code() -> None:
    documented = dict(ROW.findall(README.read_text()))
    defaults = _flat(config_to_dict(Config()))
    missing = sorted(set(defaults) - set(documented) - set(FREE_FORM))
    assert not missing, f"README's config reference lacks {missing}"
    stale = sorted(set(documented) - set(defaults))
    assert not stale, f"README's config reference documents keys the config does not have: {stale}"
    wrong = {key: (documented[key], json.dumps(value)) for key, value in defaults.items()
             if key in documented and json.loads(documented[key]) != value}
    assert not wrong, f"README defaults differ from the code (README, code): {wrong}"


COMMAND = re.compile(r"(?:^|\s)(?:\S*/)?pipetransformer(?:\.cli)?\s+(train|plan|replay|pretrain|report)\b")
ROOT = README.parent


def _readme_commands() -> list[list[str]]:
    """Every ``pipetransformer`` command in the README's bash blocks, as argv after the program name."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)
    commands = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        match = COMMAND.search(line)
        if match:
            commands.append(shlex.split(line[match.start(1):], comments=True))
    return commands


def test_readme_commands_parse_and_their_configs_load() -> None:
    """A usage line that no longer matches the CLI or the config rules fails here, not in a user's shell."""
    commands = _readme_commands()
    assert len(commands) >= 10, f"expected the README's usage lines, found {len(commands)}"
    for argv in commands:
        args = _parser().parse_args(argv)
        if getattr(args, "config", None) is not None:
            args.config = str(ROOT / args.config)  # the README's paths are relative to the clone
        try:
            if args.command == "plan":
                _plan_config(args)
            elif getattr(args, "config", None) is not None:
                load_config(args.config, args.overrides)
        except ConfigError as error:
            raise AssertionError(f"README: pipetransformer {shlex.join(argv)}: {error}") from error
