from __future__ import annotations

import shutil

import pytest

from .procs import Procs


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.fixture
def fedshield_bin() -> str:
    path = shutil.which("fedshield")
    assert path, "the fedshield console script must be installed (pip install -e .)"
    return path
