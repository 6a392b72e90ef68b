"""Every command in scripts/ answers --help: its usage on stdout, exit 0 (tests/test_layering.py
checks that scripts/ holds commands only)."""

from __future__ import annotations

import importlib

import pytest

from tests.helpers import ROOT

COMMANDS = sorted(p.stem for p in (ROOT / "scripts").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("name", COMMANDS)
def test_command_answers_help(name, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    command = importlib.import_module(f"scripts.{name}")
    with pytest.raises(SystemExit) as exit_:
        command.main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")
