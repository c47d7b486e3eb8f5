"""A search trial's process pays for what it uses (issue 33, item 4, "per-trial fixed cost").

Every Tune trial starts a fresh process that imports the trial's module and sets torch's kernel
modes before it builds its model. Neither should load what the trial never runs: Sigstore's stack
(``model_signing``: the driver signs exported models) or torch's Inductor and Dynamo (which
``torch.use_deterministic_algorithms`` imports to set one flag; govray compiles nothing).
The test runs in a fresh interpreter: this one has imported them all.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.processes import python

UNUSED = ("model_signing", "torch._inductor", "torch._dynamo")

TRIAL_PROCESS = f"""
import json, sys
import torch
import govray.platform.search.tune_trial
from govray.config.training import TrainingSettings
from govray.train.reproduce.record import use_deterministic_mode

use_deterministic_mode(TrainingSettings(deterministic=True))
seen = {{"unused": sorted(name for name in {UNUSED!r} if name in sys.modules),
        "on": torch.are_deterministic_algorithms_enabled()}}
import torch._inductor.config as inductor
seen["inductor_on"] = inductor.deterministic
use_deterministic_mode(TrainingSettings())
seen["off"] = [torch.are_deterministic_algorithms_enabled(), inductor.deterministic]
print(json.dumps(seen))
"""


@pytest.mark.slow  # a fresh interpreter importing torch, Ray Tune and Ray Train: 5 s or more
def test_a_trial_process_imports_no_signing_stack_or_compiler() -> None:
    seen = json.loads(python("-c", TRIAL_PROCESS).splitlines()[-1])
    assert seen == {"unused": [], "on": True, "inductor_on": True, "off": [False, False]}, (
        f"{sys.executable}: {seen}"
    )
