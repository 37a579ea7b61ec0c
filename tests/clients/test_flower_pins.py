"""The Flower internals the warm agent relies on (clients/flower_pins.py): a Flower upgrade that moves one
fails here by name, not as a hung or silently slow agent."""

from __future__ import annotations

import importlib
import inspect

import flwr
import pytest

from clients import flower_pins


def test_flower_is_the_pinned_version():
    assert flwr.__version__ == flower_pins.FLWR_VERSION, (
        f"clients/flower_pins.py is pinned to flwr {flower_pins.FLWR_VERSION}; found {flwr.__version__}: recheck "
        "every entry of PINNED and the sleeps it shortens, then update FLWR_VERSION")


@pytest.mark.parametrize("module, name", flower_pins.PINNED, ids=[f"{m}.{n}" for m, n in flower_pins.PINNED])
def test_each_pinned_internal_exists(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} moved"


def test_the_supernode_sleeps_it_shortens_are_still_there():
    source = inspect.getsource(importlib.import_module("flwr.supernode.start_client_internal"))
    assert f"time.sleep({flower_pins.EMPTY_PULL_SLEEP:g})" in source, "the 3 s sleep after an empty pull moved"
    assert f"time.sleep({flower_pins.REPLY_POLL_SLEEP})" in source, "the 0.5 s wait for a reply moved"
    assert "pull_objects(" in source


def test_patched_sleeps_are_short_and_others_unchanged(monkeypatch):
    sci = importlib.import_module("flwr.supernode.start_client_internal")
    monkeypatch.setattr(sci, "time", sci.time)
    monkeypatch.setattr(sci, "pull_objects", sci.pull_objects)
    slept = []
    monkeypatch.setattr(flower_pins.time, "sleep", slept.append)
    flower_pins.patch_supernode(0.2)
    for s in (3, 0.5, 7):
        sci.time.sleep(s)
    assert slept == [0.2, 0.01, 7]
    assert sci.pull_objects.keywords == {"initial_backoff": 0.02, "backoff_cap": 1.0}
    assert sci.time.time is flower_pins.time.time


def test_the_runtime_api_method_the_secret_protects():
    source = inspect.getsource(importlib.import_module("flwr.supercore.superexec.run_superexec"))
    assert repr(flower_pins.AUTH_METHOD)[1:-1] in source


def test_the_serverapp_grid_retries_reply_objects_from_20_ms(monkeypatch):
    grid = importlib.import_module("flwr.superlink.grid.http_grid")
    monkeypatch.setattr(grid, "pull_objects", grid.pull_objects)
    flower_pins.patch_grid()
    flower_pins.patch_grid()  # idempotent: one partial, not one wrapped in another
    assert grid.pull_objects.keywords == {"initial_backoff": 0.02, "backoff_cap": 1.0}
    assert not isinstance(grid.pull_objects.func, type(grid.pull_objects))


def test_the_worker_pulls_message_objects_from_20_ms(monkeypatch):
    run = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    monkeypatch.setattr(run, "pull_and_inflate_object_from_tree", run.pull_and_inflate_object_from_tree)
    flower_pins.patch_worker()
    flower_pins.patch_worker()
    assert run.pull_and_inflate_object_from_tree.keywords == {"initial_backoff": 0.02, "backoff_cap": 1.0}
    source = inspect.getsource(run.pull_task_input)
    assert "pull_and_inflate_object_from_tree(" in source  # resolved from the module at call time
