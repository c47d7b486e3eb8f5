"""The default tier keeps its budget: a marker-less test over it fails, a tier-marked one does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_marker_less_test_over_the_budget_fails_and_a_slow_marked_one_passes(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    cluster: cluster\n")
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "import tests.helpers.tiers as tiers\n"
        "from tests.helpers.tiers import pytest_fixture_setup, pytest_runtest_makereport\n"
        "tiers.TEST_BUDGET_S = 0.3\n"
        "tiers.SHARED_BUDGET_S = 0.3\n"
        "@pytest.fixture\n"
        "def slow_setup():\n"
        "    import time; time.sleep(0.2)\n"
        "@pytest.fixture(scope='session')\n"
        "def slow_shared():\n"
        "    import time; time.sleep(0.5)\n"
    )
    (tmp_path / "test_budget.py").write_text(
        "import time, pytest\n"
        "def test_quick():\n    pass\n"
        "def test_too_slow():\n    time.sleep(0.5)\n"
        "def test_slow_by_its_function_fixture(slow_setup):\n    time.sleep(0.2)\n"
        "@pytest.mark.slow\n"
        "def test_marked_slow():\n    time.sleep(0.5)\n"
        "@pytest.mark.slow\n"
        "def test_marked_slow_sets_up_the_shared(slow_shared):\n    pass\n"
        "def test_uses_the_shared_after_it_was_set_up(slow_shared):\n    pass\n"
    )
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", str(tmp_path)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "2 failed, 4 passed" in out, out
    assert "FAILED test_budget.py::test_too_slow" in out
    assert "FAILED test_budget.py::test_slow_by_its_function_fixture" in out
    assert "over the default tier's 0 s per test" in out  # the budget, as the report states it
    # The shared fixture was set up by a slow-marked test: its time is that tier's, not this one's.
    assert "test_uses_the_shared_after_it_was_set_up" not in out.split("short test summary")[-1]


def test_a_shared_fixture_over_its_budget_fails_the_marker_less_test_that_set_it_up(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "import tests.helpers.tiers as tiers\n"
        "from tests.helpers.tiers import pytest_fixture_setup, pytest_runtest_makereport\n"
        "tiers.SHARED_BUDGET_S = 0.2\n"
        "@pytest.fixture(scope='session')\n"
        "def golden():\n"
        "    import time; time.sleep(0.4)\n"
    )
    (tmp_path / "test_shared.py").write_text(
        "def test_first(golden):\n    pass\ndef test_second(golden):\n    pass\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    assert "shared fixture 'golden' took" in done.stdout
