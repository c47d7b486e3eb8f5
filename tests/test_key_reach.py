"""A trial cannot reach the platform's key (issue 49, item 1): a 2-worker run whose trial gathers
everything its processes can reach — its environment, every readable process's environment and
command line, every string on its stack (the worker's attempt, spec and signer channel among them),
every file it can read below ``/tmp`` and its working directory (Ray's session, the storage, the
checkpoints) written since the key was made (an older file cannot hold it), searched again once a
checkpoint was sealed — while rank 0's checkpoints are sealed by the platform's signer: none of it
holds the key, in any form (its PEM, its raw bytes, their hex or base64), and every checkpoint
verifies under the operator's trust, signed by that key.

``GOVRAY_HOME`` is left out of the search: this machine's development signer runs as the test's
own OS user, so its key file there is readable by design (the deployment's OS users close that:
README, "The platform's signer").
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import ray
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ray.train.v2._internal.state.state_actor import get_state_actor

from govray.core.keys import platform_key, platform_key_path
from govray.core.settings import operator_trust
from govray.platform.run.runner import run_trial
from govray.train.checkpoints.files import find_checkpoints, verify_checkpoint
from jobs.examples.digits.golden import opened
from tests.helpers.key_search_trial import key_search_example


def key_forms() -> list[bytes]:
    """The platform key as a search might meet it: its file's PEM body, its raw bytes, their hex
    and base64."""
    pem = platform_key_path().read_bytes()
    private = serialization.load_pem_private_key(pem, password=None)
    assert isinstance(private, Ed25519PrivateKey)
    raw = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    body = b"".join(line for line in pem.splitlines() if line and not line.startswith(b"-----"))
    return [body, raw, raw.hex().encode(), base64.b64encode(raw), base64.urlsafe_b64encode(raw).rstrip(b"=")]


def key_made() -> float:
    """When the platform key was written (seconds since the epoch, a second early for filesystems
    with coarse timestamps): no file last written before then can hold it."""
    return platform_key_path().stat().st_mtime - 1.0


def holds_key(data: bytes, forms: list[bytes]) -> bool:
    return any(form in data for form in forms)


@pytest.fixture(scope="module")
def searched_run(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    root = tmp_path_factory.mktemp("key-reach")
    probes = root / "found"
    probes.mkdir()
    example = key_search_example(root, probes, key_made())
    config, store, checked, experiment, ingested = opened(example)
    # What the dashboard's Train page shows: Ray Train's state actor keeps each run's config
    # (off by default; clusters that want the page turn it on).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
        outcome = run_trial(config, checked, experiment, ingested.root, store)
    return outcome, probes


def test_a_trial_that_searches_all_it_can_reach_finds_no_platform_key_while_its_checkpoints_are_signed(
    searched_run: tuple[object, Path],
) -> None:
    outcome, probes = searched_run
    forms = key_forms()
    found = [json.loads(path.read_text()) for path in sorted(probes.glob("*.json"))]
    assert len({entry["pid"] for entry in found}) >= 3  # the driver's routing build and both workers'
    assert len(found) >= 5  # ... and both workers again in step 3
    run_dir = Path(outcome.run_dir)  # type: ignore[attr-defined]
    checkpoints = find_checkpoints(run_dir)
    assert checkpoints
    for folder in checkpoints:  # sealed by the key no trial reached
        assert verify_checkpoint(folder, operator_trust())[1] == platform_key().keyid

    searched_files: set[str] = set()
    for entry in found:
        reached = [
            *entry["environ"].values(),
            *(text for texts in entry["processes"].values() for text in texts),
            *entry["stack"],
        ]
        assert not [text for text in reached if holds_key(text.encode(), forms)], entry["pid"]
        searched_files.update(entry["files"])
    # The search was not empty: it reached the worker's attempt (its channel's capability) and the
    # storage's checkpoints ...
    stacks = "".join(text for entry in found for text in entry["stack"])
    capabilities = set(re.findall(r"""['"]capability['"]:\s*['"]([A-Za-z0-9_-]{40,})['"]""", stacks))
    assert capabilities
    sealed = {str(folder / "manifest.sig") for folder in checkpoints}
    assert sealed & searched_files  # the step-2 checkpoint, which the step-3 searches reached
    # ... and found no key there: no file it could read holds one.
    holding = []
    for name in sorted(searched_files):
        try:
            data = Path(name).read_bytes()
        except OSError:
            continue  # gone since (a temporary file of Ray's)
        if holds_key(data, forms):
            holding.append(name)
    assert holding == []


def test_ray_trains_state_shows_the_runs_attempt_without_its_signer_capability(
    searched_run: tuple[object, Path],
) -> None:
    """What the dashboard's Train page shows of a run (Ray Train's state actor keeps each run's
    ``train_loop_config`` when state tracking is on) names its signer channel, but not the
    capability the workers held."""
    outcome, probes = searched_run
    stacks = "".join(text for path in probes.glob("*.json") for text in json.loads(path.read_text())["stack"])
    capabilities = set(re.findall(r"""['"]capability['"]:\s*['"]([A-Za-z0-9_-]{40,})['"]""", stacks))
    assert capabilities
    actor = get_state_actor()
    assert actor is not None
    runs = ray.get(actor.get_train_runs.remote())
    name = Path(outcome.run_dir).name  # type: ignore[attr-defined]
    (shown,) = [run.model_dump_json() for run in runs.values() if run.name == name]
    assert Path(outcome.run_dir).as_posix() in shown and '"signer"' in shown  # type: ignore[attr-defined]
    assert not [capability for capability in capabilities if capability in shown]
