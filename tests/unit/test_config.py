"""Config loading and validation: every mistake is a one-line ConfigError that names the key to change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetransformer.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))
VIT = {"model": {"kind": "vit"}, "data": {"name": "digits"}}
SECTIONS = [name for name, value in config_to_dict(Config()).items() if isinstance(value, dict)]


def _error(values: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        config_from_dict(values)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_defaults_are_valid() -> None:
    config = config_from_dict({})
    config.validate()
    assert config == Config()


def test_to_dict_round_trips() -> None:
    config = load_config(CONFIGS / "tiny_vit.yaml")
    assert config_from_dict(config_to_dict(config)) == config


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_config_loads(path: Path) -> None:
    config = load_config(path)
    assert config.run.name == path.stem


def test_unknown_top_level_key_names_it_and_the_allowed_ones() -> None:
    message = _error({"sede": 1})
    assert "'sede'" in message
    assert "seed" in message and "train" in message


def test_unknown_nested_key_names_the_full_key_and_the_section_keys() -> None:
    message = _error({"train": {"lrr": 1e-3}})
    assert "'train.lrr'" in message
    assert "lr" in message.split("allowed")[1] and "batch_size" in message


def test_non_string_keys_are_unknown_keys_not_a_crash() -> None:
    assert "'1'" in _error({1: 2, "zzz": 3})


@pytest.mark.parametrize(("values", "key", "expected"), [
    ({"train": {"batch_size": "32"}}, "train.batch_size", "integer"),
    ({"train": {"batch_size": True}}, "train.batch_size", "integer"),
    ({"train": {"batch_size": 3.5}}, "train.batch_size", "integer"),
    ({"train": {"lr": "fast"}}, "train.lr", "number"),
    ({"train": {"lr": False}}, "train.lr", "number"),
    ({"run": {"progress": "yes"}}, "run.progress", "true or false"),
    ({"model": {"vit": [1, 2]}}, "model.vit", "mapping"),
    ({"train": [1, 2]}, "train", "mapping"),
    ({"freeze": {"schedule": [[1, "a"]]}}, "freeze.schedule[0][1]", "integer"),
    ({"run": {"dir": 5}}, "run.dir", "string"),
    ({"pipe": {"stages": 2.5}}, "pipe.stages", "allowed"),
])
def test_wrong_types_name_the_key_and_the_expected_type(values: dict[str, Any], key: str, expected: str) -> None:
    message = _error(values)
    assert message.startswith(f"{key}:") or f"'{key}'" in message
    assert expected in message


def test_ints_widen_to_float() -> None:
    config = config_from_dict({"train": {"lr": 1}})
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_numbers_are_rejected(value: float) -> None:
    assert "train.lr" in _error({"train": {"lr": value}})


@pytest.mark.parametrize(("values", "key", "allowed"), [
    ({"train": {"optimizer": "adam"}}, "train.optimizer", "'adamw' | 'sgd'"),
    ({"model": {"kind": "gpt"}}, "model.kind", "'vit'"),
    ({"pipe": {"stages": "many"}}, "pipe.stages", "'auto'"),
    ({"pipe": {"schedule": "1F1B"}}, "pipe.schedule", "'1f1b'"),
    ({"train": {"precision": "fp16"}}, "train.precision", "'fp32' | 'bf16'"),
])
def test_literal_values_list_the_allowed_ones(values: dict[str, Any], key: str, allowed: str) -> None:
    message = _error(values)
    assert message.startswith(key) and allowed in message


def test_int_or_auto_fields_take_both() -> None:
    assert config_from_dict({"pipe": {"stages": 2, "micro_batches": "auto"}}).pipe.stages == 2


@pytest.mark.parametrize(("key", "value"), [
    ("train.epochs", 0), ("train.batch_size", -1), ("train.eval_batch_size", 0), ("data.max_length", 0),
    ("run.log_every", 0), ("freeze.interval", 0), ("checkpoint.keep", 0), ("train.max_steps", 0),
    ("data.max_train_samples", 0), ("checkpoint.every_steps", -5), ("train.lr", 0.0), ("train.lr", -1e-3),
    ("train.warmup_fraction", 1.0), ("data.validation_fraction", 0.0), ("data.validation_fraction", 1.0),
    ("freeze.alpha", 0.0), ("freeze.alpha", 1.5), ("freeze.percentile", 101.0), ("freeze.max_fraction", -0.1),
    ("freeze.max_change", 0.0), ("freeze.max_advance", 0), ("freeze.learned_min_steps", 0),
    ("pipe.stages", 0), ("pipe.micro_batches", 0), ("pipe.device_memory_gb", 0.0), ("cache.memory_gb", -1.0),
    ("cache.min_frozen", 0), ("train.weight_decay", -0.1), ("train.momentum", 1.0), ("train.grad_clip", 0.0),
    ("dist.timeout_s", 0.0), ("dist.threads_per_worker", 0), ("pipe.link_bandwidth_gbps", -1.0),
])
def test_numbers_out_of_range_name_the_key(key: str, value: float) -> None:
    section, name = key.split(".")
    message = _error({**VIT, section: {**VIT.get(section, {}), name: value}})
    assert message.startswith(key), message


@pytest.mark.parametrize(("values", "needle"), [
    ({"dp": {"enabled": True}}, "pipe.enabled"),
    ({"cache": {"enabled": True}}, "freeze.enabled"),
    ({"model": {"kind": "vit"}}, "model.kind vit for image data"),
    ({"data": {"name": "digits"}}, "model.kind vit for image data"),
    ({"data": {"name": "text_csv"}}, "data.path"),
    ({**VIT, "data": {"name": "image_folder"}}, "data.path"),
    ({"model": {"kind": "hf"}}, "model.path"),
    ({"freeze": {"enabled": True, "policy": "schedule"}}, "freeze.schedule"),
    ({"freeze": {"schedule": [[1, 2, 3]]}}, "freeze.schedule"),
    ({"freeze": {"schedule": [[-1, 2]]}}, "freeze.schedule"),
    ({"freeze": {"schedule": [[5, 2], [3, 4]]}}, "freeze.schedule"),
    ({"freeze": {"schedule": [[1, 4], [3, 2]]}}, "freeze.schedule"),
    ({"pipe": {"recompute": True, "device_memory_gb": 1.0}}, "set pipe.enabled: true"),
    ({"pipe": {"enabled": True, "recompute": True}}, "set a budget"),
    ({"pipe": {"enabled": True, "recompute": True, "device_memory_gb": 1.0}},
     "set dp.enabled: true, or fix pipe.stages"),
])
def test_cross_field_rules(values: dict[str, Any], needle: str) -> None:
    assert needle in _error(values)


def test_cross_field_rules_accept_consistent_settings() -> None:
    config = config_from_dict({"pipe": {"enabled": True}, "dp": {"enabled": True},
                               "freeze": {"enabled": True, "policy": "schedule", "schedule": [[1, 2], [3, 2]]},
                               "cache": {"enabled": True}})
    assert config.dp.enabled and config.freeze.schedule == [[1, 2], [3, 2]]
    fixed = config_from_dict({"pipe": {"enabled": True, "stages": 2, "recompute": True, "device_memory_gb": 1.0}})
    assert fixed.pipe.recompute


def test_overrides_set_nested_keys_with_yaml_values() -> None:
    values = apply_overrides({"train": {"lr": 1.0}}, [
        "train.lr=1e-4", "train.batch_size=8", "pipe.stages=auto", "model.vit.depth=3", "run.progress=false",
        "freeze.schedule=[[1, 2], [3, 4]]", "run.dir=/tmp/a=b",
    ])
    assert values["train"] == {"lr": 1e-4, "batch_size": 8}
    assert values["pipe"] == {"stages": "auto"}
    assert values["model"] == {"vit": {"depth": 3}}
    assert values["run"] == {"progress": False, "dir": "/tmp/a=b"}
    assert values["freeze"]["schedule"] == [[1, 2], [3, 4]]


def test_override_without_value_is_null() -> None:
    assert apply_overrides({}, ["train.max_steps="]) == {"train": {"max_steps": None}}
    assert load_config(None, ["train.max_steps=", "train.grad_clip="]).train.grad_clip is None


def test_override_null_for_a_required_number_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^train\.lr: expected a number, got None"):
        load_config(None, ["train.lr="])


@pytest.mark.parametrize("item", ["train.lr", "=1", ""])
def test_override_without_key_or_equals_sign_shows_the_form(item: str) -> None:
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, [item])


def test_override_into_a_non_section_names_the_part() -> None:
    with pytest.raises(ConfigError, match="'lr' is not a section"):
        apply_overrides({"train": {"lr": 1.0}}, ["train.lr.x=1"])


def test_override_with_unparsable_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"--set train\.lr: cannot parse"):
        apply_overrides({}, ["train.lr=[1"])


def test_override_with_python_yaml_tag_is_refused() -> None:
    with pytest.raises(ConfigError, match="cannot parse"):
        apply_overrides({}, ["seed=!!python/object/apply:os.getcwd []"])


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"train": {"lr": 0.5, "epochs": 3}}))
    config = load_config(path, ["train.lr=0.25"])
    assert (config.train.lr, config.train.epochs, config.run.name) == (0.25, 3, "run")


def test_malformed_yaml_names_the_file_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("seed: 0\ntrain:\n  lr: 1\n  epochs: [1, 2\nmodel: {kind: vit}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert str(path) in message and "line 5" in message and "\n" not in message


@pytest.mark.parametrize(("text", "needle"), [("- 1\n- 2\n", "mapping"), ("\xff\xfe", "text file")])
def test_files_that_are_not_a_mapping_are_refused(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "odd.yaml"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match=needle):
        load_config(path)


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path).train == Config().train


def test_missing_file_points_to_the_shipped_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist.*configs/"):
        load_config(tmp_path / "nope.yaml")


def test_directory_is_not_a_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 200), st.floats(allow_nan=True),
                     st.text(max_size=6), st.sampled_from(["auto", "vit", "digits", "sgd", "gpipe", "text_csv"]))
_keys = st.one_of(st.sampled_from(SECTIONS + ["seed", "lr", "kind", "name", "enabled", "stages", "path"]),
                  st.text(max_size=5), st.integers(-2, 2))
_trees = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(_keys, inner, max_size=4)), max_leaves=12)
_override_keys = st.lists(st.one_of(st.sampled_from(SECTIONS + ["lr", "stages", "kind", "schedule", "vit"]),
                                    st.text(max_size=4)), min_size=0, max_size=3).map(".".join)
_overrides = st.lists(st.one_of(st.tuples(_override_keys, st.sampled_from(["=", "", "=="]), st.text(max_size=12))
                                .map("".join), st.text(max_size=20)), max_size=4)


@settings(max_examples=300, deadline=None)
@given(values=st.dictionaries(_keys, _trees, max_size=5), overrides=_overrides)
def test_any_input_gives_a_valid_config_or_a_config_error(tmp_path_factory: pytest.TempPathFactory,
                                                          values: dict[Any, Any], overrides: list[str]) -> None:
    path = tmp_path_factory.mktemp("random") / "config.yaml"
    path.write_text(yaml.safe_dump(values))
    try:
        config = load_config(path, overrides)
    except ConfigError as error:
        assert "\n" not in str(error)
        return
    config.validate()
    assert config_from_dict(config_to_dict(config)) == config


@settings(max_examples=200, deadline=None)
@given(section=st.sampled_from(SECTIONS), key=st.text(max_size=8), value=_trees)
def test_random_values_in_real_sections_never_crash(section: str, key: str, value: Any) -> None:
    try:
        config_from_dict({section: {key: value}})
    except ConfigError:
        pass


def test_exponent_without_a_dot_is_a_number_in_files_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("train: {lr: 3e-4, weight_decay: 1E-2}\n")
    config = load_config(path, ["train.momentum=5e-1"])
    assert (config.train.lr, config.train.weight_decay, config.train.momentum) == (3e-4, 1e-2, 0.5)
    assert yaml.safe_load("1e-4") == "1e-4"  # plain PyYAML is left as it is
