"""Each package says its public API out loud: a sorted ``__all__`` whose names all import."""

from __future__ import annotations

import importlib

import pytest

PACKAGES = ["aggregation", "clients", "coordinator", "privacy", "simulations"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_unique_and_importable(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is None:
        pytest.skip(f"{name} defines no __all__")
    assert isinstance(exported, list | tuple)
    assert all(isinstance(n, str) for n in exported)
    assert list(exported) == sorted(exported), f"{name}.__all__ must be sorted"
    assert len(set(exported)) == len(exported), f"{name}.__all__ has duplicates"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names that do not import: {missing}"
    for n in exported:
        assert getattr(module, n) is not None
    # `from package import *` works, too
    namespace: dict = {}
    exec(f"from {name} import *", namespace)  # noqa: S102 - fixed package names
    assert set(exported) <= set(namespace)


@pytest.mark.parametrize("name", ["aggregation", "clients", "privacy"])
def test_packages_with_a_facade_define_all(name):
    assert hasattr(importlib.import_module(name), "__all__")


@pytest.mark.parametrize(("name", "error"), [("aggregation", "AggregationError"), ("clients", "ClientError"),
                                             ("privacy", "PrivacyError")])
def test_one_root_error_per_package_is_exported(name, error):
    cls = getattr(importlib.import_module(name), error)
    assert issubclass(cls, ValueError)


def test_pyproject_run_config_lists_every_key_with_its_default():
    """``flwr run . --run-config`` can only override keys the app declares."""
    import tomllib
    from pathlib import Path

    from coordinator.config import RunConfig

    doc = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert doc["tool"]["flwr"]["app"]["config"] == RunConfig().to_mapping()


def test_the_base_install_leaves_ray_out_and_the_simulation_extra_brings_it():
    """Edge agents install fedshield without Ray (~220 MB); Flower's engine is the ``simulation`` extra,
    which ``dev`` (what CI and README's set-up install) takes."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    names = [dep.split(";")[0].replace(" ", "") for dep in project["dependencies"]]
    assert "flwr==1.42.0" in names and not any("ray" in n or "[simulation]" in n for n in names), names
    extras = project["optional-dependencies"]
    assert extras["simulation"] == ["flwr[simulation]==1.42.0"]
    assert "fedshield[simulation]" in extras["dev"]
