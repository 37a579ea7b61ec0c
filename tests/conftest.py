"""Shared fixtures: CPU only, quiet Flower, TaskIdentity for building messages."""

from __future__ import annotations

import os

os.environ.setdefault("FEDSHIELD_DEVICE", "cpu")
os.environ.setdefault("FEDSHIELD_TORCH_THREADS", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _task_identity() -> None:
    from simulations.inprocess import ensure_task_identity

    ensure_task_identity()
