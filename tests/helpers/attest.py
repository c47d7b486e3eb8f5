"""What an attestation's DSSE envelope says: its in-toto statement, decoded."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any


def statement_of(path: Path) -> dict[str, Any]:
    envelope = json.loads(path.read_text())
    return json.loads(base64.b64decode(envelope["payload"]))
