"""The digits trial, searching for the platform's key as a bad-faith engineer's trial would: every
``build_model`` call (on the driver's meta-device routing build and on each worker), and each
worker's first ``loss`` call once a file matches the glob its hyperparameter ``probe_after`` names
(a sealed checkpoint's signature), writes one JSON file into the directory its hyperparameter
``probe_dir`` names, holding everything the process could reach:

- its environment, and the environment and command line of every process it can read
  (``/proc/*/environ``, ``/proc/*/cmdline``: Ray's workers, raylets, the driver, the signer);
- every string in the local variables of every frame on its stack (where the worker's attempt,
  its spec and its signer's channel lie);
- the paths of every file it can read below ``/tmp`` (Ray's session directory, the experiment's
  storage, the run's checkpoints) and its working directory that was written since the time its
  hyperparameter ``probe_since`` names (the platform key's creation: an older file cannot hold
  it), except ``GOVRAY_HOME``: this machine's development signer runs as the same OS user, so its
  key file there is readable by design (a deployment's OS users close that; the cluster tier
  searches as another user).

The test reads the files those paths name and looks for the key itself; the trial only gathers
(it cannot know which bytes are the key). The arithmetic is the digits trial's."""

from __future__ import annotations

import glob
import inspect
import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from govray import Batch
from jobs.examples.digits.trial import DigitsTrial


class KeySearchingDigitsTrial(DigitsTrial):
    searched_after = False

    def build_model(self) -> nn.Module:
        self._search()
        return super().build_model()

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        if not self.searched_after and glob.glob(str(self.hparams["probe_after"])):
            self.searched_after = True
            self._search()
        return super().loss(model, batch)

    def _search(self) -> None:
        found = {
            "pid": os.getpid(),
            "uid": os.getuid(),
            "environ": dict(os.environ),
            "processes": _processes(),
            "stack": _stack_strings(),
            "files": _readable_files(float(self.hparams["probe_since"])),
        }
        path = Path(str(self.hparams["probe_dir"])) / f"{uuid.uuid4().hex}.json"
        path.write_text(json.dumps(found))


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


def _readable_files(since: float) -> list[str]:
    """Every regular file below ``/tmp`` and the working directory this process may read, written
    at or after ``since`` (seconds since the epoch), outside ``GOVRAY_HOME``."""
    home = Path(os.environ.get("GOVRAY_HOME", "/nonexistent")).resolve()
    found = []
    for root in {Path("/tmp").resolve(), Path.cwd().resolve()}:
        for directory, _, names in os.walk(root):
            if Path(directory).resolve().is_relative_to(home):
                continue
            for name in names:
                path = os.path.join(directory, name)
                try:
                    held = os.stat(path, follow_symlinks=False)
                except OSError:
                    continue  # gone while walking (a temporary file of Ray's)
                if stat.S_ISREG(held.st_mode) and held.st_mtime >= since and os.access(path, os.R_OK):
                    found.append(path)
    return found


def key_search_example(root: Path, probes: Path, since: float, **overrides: Any) -> Path:
    """The digits example under ``root`` on 2 workers with this trial: 4 steps, a checkpoint
    sealed at step 2 and searched for in step 3, probes written to ``probes``, files written since
    ``since`` searched. ``overrides``: further top-level keys of the experiment file."""
    from jobs.examples.digits.golden import GOLDEN_HPARAMS, golden_example

    return golden_example(
        root,
        workers=2,
        max_length={"batches": 4},
        hparams={
            **GOLDEN_HPARAMS,
            "probe_dir": str(probes),
            "probe_since": since,
            "probe_after": str(root / "storage" / "ray" / "*" / "checkpoint_00000002" / "manifest.sig"),
        },
        lr_schedule=False,
        checkpoint={"period": 2, "save_trial_latest": 10},  # sealed at step 2, searched in step 3
        trial="tests.helpers.key_search_trial:KeySearchingDigitsTrial",
        **overrides,
    )
