"""A pickle a bad-faith engineer plants in storage: unpickling it creates a marker file. Nothing of
govray's or the tests' is needed to unpickle it (it calls the builtin ``open``), so a marker that
was not created means nobody unpickled it."""

from __future__ import annotations

import pickle
from pathlib import Path


class Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def planted_pickle(marker: Path) -> bytes:
    return pickle.dumps(Planted(marker))
