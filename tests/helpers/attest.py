"""What an attestation's DSSE envelope says: its in-toto statement, decoded."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any


def statement_of(path: Path) -> dict[str, Any]:
    envelope = json.loads(path.read_text())
    return json.loads(base64.b64decode(envelope["payload"]))


def copied_checkpoint(checkpoint: Path, storage: Path) -> Path:
    """``checkpoint`` (``STORAGE/ray/RUN/checkpoint_N``) and its run's spec (``STORAGE/runs/RUN.json``)
    copied into ``storage`` as a run of its own writes them; returns the copy."""
    import shutil

    copy = Path(shutil.copytree(checkpoint, storage / "ray" / checkpoint.parent.name / checkpoint.name))
    (storage / "runs").mkdir(parents=True, exist_ok=True)
    run_json = checkpoint.parent.parent.parent / "runs" / f"{checkpoint.parent.name}.json"
    shutil.copy(run_json, storage / "runs" / run_json.name)
    return copy
