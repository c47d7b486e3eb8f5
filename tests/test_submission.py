"""What `govray submit` sends to the Ray Jobs API, and what it refuses before sending anything
(no cluster needed: the cluster tier submits for real, in tests/cluster/test_job_submit.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from govray.cli import main
from govray.core.errors import ConfigError
from govray.platform.submission import (
    PINS_ENV,
    PinsDiffer,
    pin_mismatches,
    pinned_packages,
    plan_submission,
    verify_pins,
)
from tests.helpers.builders import REPO


@pytest.fixture
def project(tmp_path: Path, example_copy: Path) -> Path:
    """A project directory: the digits example (its trial, data and policy) with shared storage."""
    root = tmp_path / "project"
    shutil.copytree(example_copy.parent, root / "digits")
    raw = yaml.safe_load((root / "digits" / "experiment.yaml").read_text())
    raw["storage_path"] = str(tmp_path / "shared-storage")
    (root / "digits" / "experiment.yaml").write_text(yaml.safe_dump(raw))
    return root


def test_a_submission_runs_the_job_entry_point_with_the_pins_in_its_environment(project: Path) -> None:
    planned = plan_submission(project / "digits" / "experiment.yaml", project)
    assert planned.entrypoint == "govray job train --config digits/experiment.yaml"  # the installed govray
    assert planned.runtime_env["working_dir"] == str(project)
    assert ".git" in planned.runtime_env["excludes"]
    assert "pip" not in planned.runtime_env  # the cluster's nodes have the pins installed
    pins = json.loads(planned.runtime_env["env_vars"][PINS_ENV])
    assert pins == pinned_packages()
    assert any(pin.startswith("ray[") and pin.endswith("==2.60.0") for pin in pins)
    assert planned.metadata["experiment"] == "digits-governed"
    assert planned.submission_id.startswith("govray-digits-governed-")
    search = plan_submission(
        project / "digits" / "experiment.yaml", project, search=True, allow_unsigned=True, submission_id="s1"
    )
    assert search.entrypoint == "govray job search --config digits/experiment.yaml --allow-unsigned-policy"
    assert search.submission_id == "s1"


def test_pip_asks_ray_to_install_the_pins_except_ray_and_govray(project: Path) -> None:
    planned = plan_submission(project / "digits" / "experiment.yaml", project, pip=True)
    packages = planned.runtime_env["pip"]["packages"]
    assert "torch==2.13.0" in packages
    assert not [pin for pin in packages if pin.startswith(("ray", "govray"))]


def test_a_relative_storage_path_is_refused_it_would_land_in_the_jobs_temporary_copy(project: Path) -> None:
    config = project / "digits" / "experiment.yaml"
    raw = yaml.safe_load(config.read_text())
    raw["storage_path"] = "storage"
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="storage_path 'storage' is relative"):
        plan_submission(config, project)
    assert (
        main(["submit", str(config), "--address", "http://127.0.0.1:9", "--working-dir", str(project)]) == 2
    )


def test_an_experiment_outside_the_working_dir_or_a_dir_shipping_its_own_govray_is_refused(
    project: Path, tmp_path: Path
) -> None:
    (project / "elsewhere").mkdir()
    with pytest.raises(ConfigError, match="lies outside the working directory"):
        plan_submission(project / "digits" / "experiment.yaml", project / "elsewhere")
    config = project / "digits" / "experiment.yaml"
    for shipped, named in (
        ("govray/__init__.pyc", "govray/"),
        ("govray.py", "govray.py"),
        ("sitecustomize.py", "sitecustomize.py"),
    ):
        (project / shipped).parent.mkdir(exist_ok=True)
        (project / shipped).write_text("# a patched copy of govray\n")
        with pytest.raises(ConfigError, match=rf"holds a govray package of its own \({named}\)"):
            plan_submission(config, project)
        (project / shipped).unlink()
    shutil.copytree(REPO / "govray", project / "govray", dirs_exist_ok=True)  # govray's own tree, shipped
    with pytest.raises(ConfigError, match="holds a govray package of its own"):
        plan_submission(config, project)
    assert (
        main(["submit", str(config), "--address", "http://127.0.0.1:9", "--working-dir", str(project)]) == 2
    )


def test_a_job_refuses_packages_that_differ_from_its_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pin_mismatches(["numpy==0.1", "torch==2.13.0", "no-such-package==1"]) == [
        f"numpy==0.1 (installed {np.__version__})",
        "no-such-package==1 (not installed)",
    ]
    monkeypatch.delenv(PINS_ENV, raising=False)
    assert verify_pins() == 0  # not a submitted job: nothing to check
    monkeypatch.setenv(PINS_ENV, json.dumps(pinned_packages()))
    assert verify_pins() == len(pinned_packages())
    monkeypatch.setenv(PINS_ENV, json.dumps(["numpy==0.1"]))
    with pytest.raises(PinsDiffer, match=r"numpy==0.1 \(installed"):
        verify_pins()
    assert main(["job", "verify-pins"]) == 22


def test_an_unreachable_jobs_api_is_a_job_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # as the session's Ray has it; nothing to switch on
    assert main(["job", "status", "govray-x", "--address", "http://127.0.0.1:9"]) == 20
