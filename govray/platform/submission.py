"""Experiments as Ray jobs, through the Ray Jobs API (``ray.job_submission.JobSubmissionClient``).

A submission ships the project directory (``working_dir``: the trial's code, the experiment file,
its policy and local corpora) and runs ``govray job train`` (or ``govray job search``) on the
cluster: the console script of the govray installed there. A working directory that holds a
``govray`` package of its own is refused — on the cluster it would come first on the job's path.
That is hygiene, not a control (trial code can still patch govray in its own process): the
signer's checks are the control.
govray's pinned packages travel with it: their pins are recorded in the job's environment
(``GOVRAY_PINNED_PACKAGES``) and metadata, and the job refuses to train where the cluster's
packages differ (``govray job verify-pins``); ``pip=True`` asks Ray to install them in a per-job
virtualenv instead (that needs the package index on every node).

Ray's token authentication stays on: the client sends the token Ray's own clients read
(``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), never a runtime_env
(the dashboard shows those to anyone who may list jobs).

Example::

    jobs = RayJobs.connect("http://head:8265")
    job_id = jobs.submit(plan_submission(Path("jobs/examples/digits/experiment.yaml"), Path(".")))
    print(jobs.follow(job_id, print))   # SUCCEEDED, FAILED or STOPPED
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path
from typing import Any, TypeVar

import yaml
from packaging.requirements import Requirement
from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient

from govray.config.experiment import load_experiment
from govray.core.errors import ConfigError, GovrayError

PINS_ENV = "GOVRAY_PINNED_PACKAGES"  # JSON list of "name==version", set in the job's runtime_env
JOB_COMMANDS = {"train": ("govray", "job", "train"), "search": ("govray", "job", "search")}
# Never uploaded: history, caches, and local storage (a job writes to its own storage_path).
EXCLUDES = [".git", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis"]
# Ray refuses to install itself in a runtime_env; govray's code is the working_dir's.
NOT_PIP_INSTALLED = {"ray", "govray"}
TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
T = TypeVar("T")


class JobError(GovrayError):
    """The Ray job failed, or the Jobs API refused a request (address, token, unknown job)."""

    exit_code = 20


class JobStopped(GovrayError):
    """The Ray job was stopped before it finished."""

    exit_code = 21


class PinsDiffer(GovrayError):
    """This machine's packages differ from the pins the job was submitted with."""

    exit_code = 22


def pinned_packages() -> list[str]:
    """govray's own pins (its installed metadata: pyproject's ``dependencies``), and govray's."""
    pins = [f"govray=={version('govray')}"]
    for line in requires("govray") or []:
        requirement = Requirement(line)
        if requirement.marker is None:  # extras (dev tools) stay on the submitting machine
            pins.append(str(requirement))
    return pins


def pin_mismatches(pins: list[str]) -> list[str]:
    """``"name==pinned (installed X)"`` for each pin this Python's packages do not satisfy."""
    differing = []
    for pin in pins:
        requirement = Requirement(pin)
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            differing.append(f"{pin} (not installed)")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            differing.append(f"{pin} (installed {installed})")
    return differing


def verify_pins() -> int:
    """Check the pins a submitted job carries (``GOVRAY_PINNED_PACKAGES``) against this machine's
    packages; returns how many were checked (0 outside a submitted job). Raises ``PinsDiffer``."""
    recorded = os.environ.get(PINS_ENV)
    if not recorded:
        return 0
    pins = json.loads(recorded)
    if differing := pin_mismatches(pins):
        raise PinsDiffer(
            f"this node's packages differ from the {len(pins)} pins the job was submitted with: "
            f"{'; '.join(differing)} (install them with -c constraints.txt, or submit with --pip)"
        )
    return len(pins)


@dataclass(frozen=True)
class Submission:
    """What the Jobs API receives: the entrypoint, its runtime_env and metadata, the job's id."""

    submission_id: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str]


def plan_submission(
    config_path: Path,
    working_dir: Path,
    *,
    search: bool = False,
    allow_unsigned: bool = False,
    pip: bool = False,
    submission_id: str | None = None,
) -> Submission:
    """The job for one experiment file inside ``working_dir`` (the project root, where the trial's
    module lies). Refused (``ConfigError``) before anything is sent: a malformed experiment, one
    outside the working dir, a working dir holding its own ``govray`` package (the cluster runs its
    installed govray), and a relative ``storage_path`` (the job would write inside its temporary
    copy of the working dir)."""
    config = load_experiment(config_path)
    root = working_dir.resolve()
    try:
        relative = config_path.resolve().relative_to(root)
    except ValueError:
        raise ConfigError(
            f"{config_path} lies outside the working directory {root}: the job could not read it "
            "(pass --working-dir, the project directory that holds it)"
        ) from None
    kind = "search" if search else "train"
    if shipped := own_govray(root):
        raise ConfigError(
            f"{root} holds a govray package of its own ({shipped}): a job runs the govray installed on "
            "the cluster, never one shipped with it; submit the directory of your trial and experiment"
        )
    raw_storage = (yaml.safe_load(config_path.read_text()) or {}).get("storage_path", "./govray-storage")
    if "://" not in str(raw_storage) and not Path(str(raw_storage)).is_absolute():
        raise ConfigError(
            f"{config_path}: storage_path {raw_storage!r} is relative, so the job would write inside "
            "its temporary copy of the working directory; give s3://... or an absolute path that "
            "every node shares"
        )
    pins = pinned_packages()
    runtime_env: dict[str, Any] = {
        "working_dir": str(root),
        "excludes": EXCLUDES,
        "env_vars": {PINS_ENV: json.dumps(pins)},
    }
    if pip:
        installable = [pin for pin in pins if Requirement(pin).name.lower() not in NOT_PIP_INSTALLED]
        runtime_env["pip"] = {"packages": installable, "pip_check": False}
    command = [*JOB_COMMANDS[kind], "--config", relative.as_posix()]
    if allow_unsigned:
        command.append("--allow-unsigned-policy")
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", config.name).strip("-") or "experiment"
    return Submission(
        submission_id=submission_id or f"govray-{slug}-{uuid.uuid4().hex[:8]}",
        entrypoint=shlex.join(command),
        runtime_env=runtime_env,
        metadata={
            "govray_version": version("govray"),
            "experiment": config.name,
            "config": relative.as_posix(),
            "kind": kind,
        },
    )


def own_govray(root: Path) -> str:
    """What in ``root`` Python would import as ``govray`` before the installed one, or would run
    at interpreter start-up (``sitecustomize``, ``usercustomize``): "" for nothing."""
    package = root / "govray"
    if package.is_dir() and (any(package.glob("*.py*")) or any(package.glob("*.so"))):
        return "govray/"
    for pattern in (
        "govray.py",
        "govray.pyc",
        "govray.*.so",
        "govray.so",
        "sitecustomize.py*",
        "usercustomize.py*",
    ):
        if found := sorted(root.glob(pattern)):
            return found[0].name
    return ""


def use_cluster_token() -> None:
    """Send the cluster's token the way ``ray start`` and ``ray.init`` find it: when
    ``RAY_AUTH_MODE`` is unset and a token exists (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
    ``~/.ray/auth_token``), token mode is switched on for this process; an explicit
    ``RAY_AUTH_MODE`` (``token`` or ``disabled``) is kept."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    if "RAY_AUTH_MODE" not in os.environ and AuthenticationTokenLoader.instance().has_token(
        ignore_auth_mode=True
    ):
        os.environ["RAY_AUTH_MODE"] = "token"
        Config.initialize("")  # Ray's cached settings see the mode, as `ray start` does for itself


class RayJobs:
    """The Jobs API of one Ray cluster; every failure becomes a ``JobError`` naming the address."""

    def __init__(self, address: str, client: JobSubmissionClient) -> None:
        self.address = address
        self.client = client

    @classmethod
    def connect(cls, address: str) -> RayJobs:
        use_cluster_token()
        return cls(address, _call(address, "connect", lambda: JobSubmissionClient(address)))

    def submit(self, submission: Submission) -> str:
        return self._call(
            "submit",
            lambda: self.client.submit_job(
                entrypoint=submission.entrypoint,
                runtime_env=submission.runtime_env,
                metadata=submission.metadata,
                submission_id=submission.submission_id,
            ),
        )

    def info(self, job_id: str) -> JobDetails:
        return self._call(f"job {job_id}", lambda: self.client.get_job_info(job_id))

    def logs(self, job_id: str) -> str:
        return self._call(f"logs of job {job_id}", lambda: self.client.get_job_logs(job_id))

    def jobs(self) -> list[JobDetails]:
        return self._call("list jobs", self.client.list_jobs)

    def stop(self, job_id: str) -> bool:
        """Ask Ray to stop the job (SIGTERM to its driver, SIGKILL after Ray's grace period);
        False when it had already ended."""
        return self._call(f"stop job {job_id}", lambda: self.client.stop_job(job_id))

    def follow(self, job_id: str, write: Callable[[str], None]) -> JobStatus:
        """Stream the job's logs to ``write`` until it ends; returns its final status."""

        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(job_id):
                write(chunk)

        self._call(f"logs of job {job_id}", lambda: asyncio.run(tail()))
        return self.wait(job_id, timeout=60.0)

    def wait(self, job_id: str, timeout: float) -> JobStatus:
        """The job's status once it has ended, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.info(job_id).status
            if status in TERMINAL or time.monotonic() > deadline:
                return status
            time.sleep(0.5)

    def _call(self, what: str, request: Callable[[], T]) -> T:
        return _call(self.address, what, request)


def _call(address: str, what: str, request: Callable[[], T]) -> T:
    try:
        return request()
    except Exception as error:  # the SDK raises RuntimeError, ConnectionError, requests' errors
        message = " ".join(str(error).split()) or type(error).__name__
        raise JobError(f"Ray Jobs API at {address} ({what}): {message}") from None


def check_succeeded(details: JobDetails) -> None:
    """Raise for a job that did not succeed: ``JobError`` (failed) or ``JobStopped``."""
    if details.status == JobStatus.FAILED:
        raise JobError(f"job {details.submission_id} FAILED: {details.message or 'no message from Ray'}")
    if details.status == JobStatus.STOPPED:
        raise JobStopped(f"job {details.submission_id} was stopped: {details.message or ''}".rstrip(": "))
