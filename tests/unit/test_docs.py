"""The README's config reference lists every key with the default the code has, so the two cannot drift apart."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pipetransformer.config import Config, config_to_dict

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
