"""Reading the YAML documents users hand govray, with errors that name the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from govray.core.errors import GovrayError


def read_text(path: Path, error: type[GovrayError], what: str) -> str:
    """The file's text, or ``error("cannot read WHAT PATH: reason")``."""
    try:
        return path.read_text()
    except OSError as failure:
        raise error(f"cannot read {what} {path}: {failure.strerror}") from None


def parse_yaml_mapping(text: str, source: str, error: type[GovrayError], shape: str) -> dict[str, Any]:
    """Parse YAML that must be a mapping; ``shape`` says what the mapping should hold."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as failure:
        raise error(f"{source}: not valid YAML: {failure}") from None
    if not isinstance(raw, dict):
        raise error(f"{source}: {shape}")
    return raw
