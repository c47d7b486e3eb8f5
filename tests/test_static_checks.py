"""The code stays ruff- and mypy-clean: CI fails on a regression, not a reviewer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["govray", "jobs", "searchers", "serve", "tests"]


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], cwd=REPO, capture_output=True, text=True)


def test_ruff_finds_nothing() -> None:
    result = run("ruff", "check", *SOURCES)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow  # ~50 s of mypy over the whole tree: the slow tier
def test_mypy_finds_nothing() -> None:
    result = run("mypy", "govray", "jobs", "searchers", "serve")
    assert result.returncode == 0, result.stdout + result.stderr
