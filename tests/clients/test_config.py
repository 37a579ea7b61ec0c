"""build_config and the frozen config dataclasses: types, rules, messages."""

from __future__ import annotations

import dataclasses
import math

import pytest

from clients import ConfigError, TaskSpec, TrainSettings, build_config
from clients.config import config_keys, split_mapping, to_mapping


def test_defaults_when_mapping_is_empty():
    assert build_config(TrainSettings, {}) == TrainSettings()
    assert build_config(TaskSpec, {}) == TaskSpec()


def test_kebab_keys_map_to_fields():
    cfg = build_config(TrainSettings, {"local-epochs": 2, "batch-size": 8, "lr": 0.5, "momentum": 0.0})
    assert cfg == TrainSettings(local_epochs=2, batch_size=8, lr=0.5, momentum=0.0)
    spec = build_config(TaskSpec, {"task": "synthetic", "partitioning": "iid", "dirichlet-alpha": 2,
                                   "data-seed": 7, "synthetic-alpha": 0.5, "synthetic-beta": 0})
    assert spec == TaskSpec("synthetic", "iid", 2.0, 7, 0.5, 0.0)


@pytest.mark.parametrize(
    ("cls", "mapping", "message"),
    [
        (TrainSettings, {"lr": -1.0}, "lr must be in (0, 100]. Found -1.0."),
        (TrainSettings, {"lr": 0}, "lr must be in (0, 100]. Found 0.0."),
        (TrainSettings, {"lr": 101}, "lr must be in (0, 100]. Found 101.0."),
        (TrainSettings, {"local-epochs": 0}, "local-epochs must be in [1, 1000]. Found 0."),
        (TrainSettings, {"batch-size": 70000}, "batch-size must be in [1, 65536]. Found 70000."),
        (TrainSettings, {"momentum": 1.0}, "momentum must be in [0, 1). Found 1.0."),
        (TaskSpec, {"task": "mnist"}, "task must be one of ['digits', 'synthetic'], package.module:ClassName or path/to/file.py:ClassName. Found 'mnist'."),
        (TaskSpec, {"partitioning": "shards"}, "partitioning must be one of ['iid', 'dirichlet', 'sample']. Found 'shards'."),
        (TaskSpec, {"dirichlet-alpha": 0}, "dirichlet-alpha must be in (0, 1e6]. Found 0.0."),
        (TaskSpec, {"dirichlet-alpha": 1e308}, "dirichlet-alpha must be in (0, 1e6]. Found 1e+308."),
        (TaskSpec, {"data-seed": -1}, "data-seed must be in [0, 2**32). Found -1."),
        (TaskSpec, {"data-seed": 2**32}, "data-seed must be in [0, 2**32). Found 4294967296."),
        (TaskSpec, {"synthetic-beta": -0.5}, "synthetic-beta must be in [0, 1000]. Found -0.5."),
        # beta = 1e300 made x infinite (every reply then rejected as non-finite), alpha = 1e80 one label
        (TaskSpec, {"synthetic-beta": 1e300}, "synthetic-beta must be in [0, 1000]. Found 1e+300."),
        (TaskSpec, {"synthetic-alpha": 1e80}, "synthetic-alpha must be in [0, 1000]. Found 1e+80."),
    ],
)
def test_rule_errors_name_key_rule_and_found_value(cls, mapping, message):
    with pytest.raises(ConfigError) as info:
        build_config(cls, mapping)
    assert str(info.value) == message
    with pytest.raises(ConfigError) as info:
        build_config(cls, mapping, "train")
    assert str(info.value) == "train." + message


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("lr", "0.1", "be a finite number"),
        ("lr", None, "be a finite number"),
        ("lr", math.nan, "be a finite number"),
        ("lr", math.inf, "be a finite number"),
        ("lr", True, "be a finite number"),
        ("local-epochs", 2.5, "be an integer"),
        ("local-epochs", "3", "be an integer"),
        ("local-epochs", True, "be an integer"),
        ("batch-size", False, "be an integer"),
    ],
)
def test_type_errors_name_key_and_found_value(key, value, rule):
    with pytest.raises(ConfigError) as info:
        build_config(TrainSettings, {key: value}, "cfg")
    assert str(info.value) == f"cfg.{key} must {rule}. Found {value!r}."


@pytest.mark.parametrize(("key", "value"), [("task", 3), ("task", None), ("partitioning", b"iid")])
def test_string_fields_reject_other_types(key, value):
    with pytest.raises(ConfigError, match=f"^{key} must be a string. Found"):
        build_config(TaskSpec, {key: value})


def test_bool_is_not_an_int():
    with pytest.raises(ConfigError, match="data-seed must be an integer. Found True."):
        build_config(TaskSpec, {"data-seed": True})


def test_int_is_accepted_for_float_and_becomes_float():
    cfg = build_config(TrainSettings, {"lr": 1, "momentum": 0})
    assert cfg.lr == 1.0 and type(cfg.lr) is float
    assert type(cfg.momentum) is float


def test_integral_float_is_accepted_for_int_and_becomes_int():
    cfg = build_config(TrainSettings, {"local-epochs": 3.0})
    assert cfg.local_epochs == 3 and type(cfg.local_epochs) is int


def test_unknown_key_is_an_error_naming_it_and_the_known_keys():
    with pytest.raises(ConfigError) as info:
        build_config(TrainSettings, {"lr": 0.1, "speed": 0.1}, "cfg")  # (nothing close: every known key listed)
    msg = str(info.value)
    assert msg.startswith("cfg.speed is not a known key.")
    for key in config_keys(TrainSettings):
        assert key in msg


def test_snake_case_key_is_unknown():
    with pytest.raises(ConfigError, match="local_epochs is not a known key"):
        build_config(TrainSettings, {"local_epochs": 2})


def test_unknown_keys_ignored_when_not_strict():
    assert build_config(TrainSettings, {"lr": 0.2, "other": 1}, strict=False) == TrainSettings(lr=0.2)


@pytest.mark.parametrize("obj", [TrainSettings(), TaskSpec()])
def test_configs_are_frozen(obj):
    field = dataclasses.fields(obj)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, getattr(obj, field))


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match="lr must be in"):
        TrainSettings(lr=-1.0)
    with pytest.raises(ConfigError, match=r"dirichlet-alpha must be in \(0, 1e6\]"):
        TaskSpec(dirichlet_alpha=math.nan)


def test_to_mapping_round_trips_and_split_mapping_routes_keys():
    spec, train = TaskSpec(task="synthetic", data_seed=3), TrainSettings(lr=0.3, batch_size=4)
    flat = {**to_mapping(spec), **to_mapping(train), "round": 1}
    assert set(to_mapping(train)) == set(config_keys(TrainSettings))
    task_part, train_part = split_mapping(flat, TaskSpec, TrainSettings)
    assert build_config(TaskSpec, task_part) == spec
    assert build_config(TrainSettings, train_part) == train
    assert "round" not in task_part and "round" not in train_part


@pytest.mark.parametrize("typo, meant", [("local-epoch", "local-epochs"), ("batch_size", "batch-size"),
                                         ("learning-rate", "lr"), ("epochs", "local-epochs")])
def test_an_unknown_key_close_to_a_known_one_names_it_instead_of_listing_all(typo, meant):
    with pytest.raises(ConfigError) as info:
        build_config(TrainSettings, {typo: 1}, "cfg")
    assert str(info.value) == f"cfg.{typo} is not a known key. Did you mean {meant}?"
