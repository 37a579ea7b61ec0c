"""The front door stays true: the generated configuration reference is current, every run key is in it,
links resolve, README stays short, and the commands README shows parse."""

from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from simulations.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "configuration.md"
REGENERATE = "python docs/gen_config_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", DOCS / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_what_the_generator_writes_now():
    try:
        text = _generator().generate()
    except SystemExit as exc:  # a key without a description
        pytest.fail(f"{exc}; then run `{REGENERATE}`")
    assert REFERENCE.read_text(encoding="utf-8") == text, (
        f"docs/configuration.md is out of date with the config dataclasses: run `{REGENERATE}` and commit it")


def test_every_flower_run_config_key_is_in_the_reference():
    keys = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    reference = REFERENCE.read_text(encoding="utf-8")
    missing = [k for k in keys if f"| `{k}` |" not in reference]
    assert not missing, f"run keys missing from docs/configuration.md: {missing}; run `{REGENERATE}`"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_point_to_existing_files(page):
    broken = []
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.name} links to missing files: {broken}"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 170, f"README.md has {len(lines)} lines (at most 170: move detail to docs/)"


def _readme_commands() -> list[str]:
    """Every ``fedshield ...`` command line in README's code blocks (continuation lines joined, comments cut)."""
    commands, block, pending = [], False, ""
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            block, pending = not block, ""
            continue
        if not block:
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        for part in re.split(r"\s*(?:&&|;|\|)\s*", line):
            part = part.split(" #", 1)[0].strip().removeprefix("do ")
            if part.startswith("fedshield "):
                commands.append(part)
    return commands


def test_readme_shows_fedshield_commands():
    assert len(_readme_commands()) >= 5


@pytest.mark.parametrize("command", _readme_commands())
def test_readme_commands_parse(command):
    argv = shlex.split(command)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        if re.search(r"[A-Z]+:[A-Z]+|\.\.\.|<|\$", command):
            pytest.skip(f"a placeholder that does not parse: {command}")
        pytest.fail(f"README's `{command}` does not parse (exit {exc.code})")
