"""The digits trial, searching for the platform's key as a bad-faith engineer's trial would: every
``build_model`` call (on the driver's meta-device routing build and on each worker) writes one JSON
file into the directory its hyperparameter ``probe_dir`` names, holding everything the process
could reach:

- its environment, and the environment and command line of every process it can read
  (``/proc/*/environ``, ``/proc/*/cmdline``: Ray's workers, raylets, the driver, the signer);
- every string in the local variables of every frame on its stack (where the worker's attempt,
  its spec and its signer's channel lie);
- the paths of every file it can read below ``/tmp`` (Ray's session directory, the experiment's
  storage, the run's checkpoints) and its working directory, except ``GOVRAY_HOME``: this
  machine's development signer runs as the same OS user, so its key file there is readable by
  design (a deployment's OS users close that; the cluster tier searches as another user).

The test reads the files those paths name and looks for the key itself; the trial only gathers
(it cannot know which bytes are the key). The arithmetic is the digits trial's."""

from __future__ import annotations

import inspect
import json
import os
import uuid
from pathlib import Path

from torch import nn

from jobs.examples.digits.trial import DigitsTrial

MAX_FILE = 4 << 20  # bytes: larger files are weights and shards, listed all the same


class KeySearchingDigitsTrial(DigitsTrial):
    def build_model(self) -> nn.Module:
        found = {
            "pid": os.getpid(),
            "environ": dict(os.environ),
            "processes": _processes(),
            "stack": _stack_strings(),
            "files": _readable_files(),
        }
        path = Path(str(self.hparams["probe_dir"])) / f"{uuid.uuid4().hex}.json"
        path.write_text(json.dumps(found))
        return super().build_model()


def _processes() -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        for part in ("environ", "cmdline"):
            try:
                seen.setdefault(entry.name, []).append((entry / part).read_bytes().decode(errors="replace"))
            except OSError:
                continue
    return seen


def _stack_strings() -> list[str]:
    """Every local variable of every frame on this stack, as its repr and (a pydantic model,
    the attempt and spec among them) its JSON."""
    strings = []
    for frame in inspect.stack():
        for value in frame.frame.f_locals.values():
            try:
                strings.append(repr(value)[:200_000])
                if hasattr(value, "model_dump_json"):
                    strings.append(value.model_dump_json())
            except Exception:  # a local whose repr fails is no secret's carrier
                continue
    return strings


def _readable_files() -> list[str]:
    home = Path(os.environ.get("GOVRAY_HOME", "/nonexistent")).resolve()
    found = []
    for root in {Path("/tmp").resolve(), Path.cwd().resolve()}:
        for directory, _, names in os.walk(root):
            if Path(directory).resolve().is_relative_to(home):
                continue
            for name in names:
                path = Path(directory) / name
                if path.is_file() and not path.is_symlink() and os.access(path, os.R_OK):
                    found.append(str(path))
    return found
