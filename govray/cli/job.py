"""``govray submit`` and ``govray job logs | status | stop | list | verify-pins | train | search``:
experiments as Ray jobs on a cluster, through the Ray Jobs API (the head's dashboard address, port
8265). ``job train`` and ``job search`` are what a submitted job runs on the cluster: the govray
installed there, never a copy shipped with the job."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from govray.cli.common import AllowUnsigned, ConfigArgument, console, table

if TYPE_CHECKING:
    from ray.job_submission import JobDetails

    from govray.platform.submission import RayJobs

app = typer.Typer(no_args_is_help=True, help="Ray jobs on a cluster: logs, status, stop, list.")

Address = typer.Option(
    ...,
    "--address",
    envvar="RAY_API_SERVER_ADDRESS",
    help="The cluster's Jobs API, e.g. http://HOST:8265 (else RAY_API_SERVER_ADDRESS).",
)
JobArgument = typer.Argument(..., help="The job's submission id (govray submit prints it).")


def submit(
    config_path: Path = ConfigArgument,
    address: str = Address,
    working_dir: Path = typer.Option(
        Path("."),
        "--working-dir",
        help="Project directory shipped to the cluster (the trial's code and CONFIG; never a govray copy).",
    ),
    search: bool = typer.Option(False, "--search", help="Run the experiment's search (govray job search)."),
    pip: bool = typer.Option(
        False, "--pip", help="Have Ray pip-install govray's pins in a per-job virtualenv on each node."
    ),
    submission_id: str | None = typer.Option(
        None, "--submission-id", help="The job's id (default: govray-EXPERIMENT-RANDOM)."
    ),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Stream the job's logs until it ends."),
    allow_unsigned: bool = AllowUnsigned,
) -> None:
    """Run the experiment as a Ray job on the cluster (govray job train, or govray job search).

    Prints the job's id; with --wait (the default) streams its logs and exits 0 when it
    succeeded, 20 when it failed, 21 when it was stopped. Ctrl-C stops following, not the job.
    """
    from govray.platform.submission import RayJobs, plan_submission

    planned = plan_submission(
        config_path,
        working_dir,
        search=search,
        allow_unsigned=allow_unsigned,
        pip=pip,
        submission_id=submission_id,
    )
    jobs = RayJobs.connect(address)
    job_id = jobs.submit(planned)
    console.print(f"submitted job {job_id} to {address}: {planned.entrypoint}", highlight=False)
    if not wait:
        follow = f"govray job logs {job_id} --follow --address {address}"
        console.print(f"follow it with: {follow}", highlight=False)
        return
    _follow(jobs, job_id)


def _follow(jobs: RayJobs, job_id: str) -> None:
    from govray.platform.submission import check_succeeded

    try:
        jobs.follow(job_id, _write)
    except KeyboardInterrupt:
        console.print(f"\nstopped following; the job runs on (govray job stop {job_id})", highlight=False)
        raise
    details = jobs.info(job_id)
    console.print(_status_line(details), highlight=False)
    check_succeeded(details)


def _write(chunk: str) -> None:
    sys.stdout.write(chunk)
    sys.stdout.flush()


def _status_line(details: JobDetails) -> str:
    took = ""
    if details.start_time and details.end_time:
        took = f" after {(details.end_time - details.start_time) / 1000:.1f} s"
    message = f": {details.message}" if details.message else ""
    return f"job {details.submission_id} {details.status.value}{took}{message}"


@app.command()
def logs(
    job_id: str = JobArgument,
    address: str = Address,
    follow: bool = typer.Option(
        False, "--follow", help="Stream until the job ends; exit 0, 20 (failed) or 21 (stopped)."
    ),
) -> None:
    """The job's driver output so far (what ``govray job train`` printed)."""
    from govray.platform.submission import RayJobs

    jobs = RayJobs.connect(address)
    if follow:
        _follow(jobs, job_id)
        return
    _write(jobs.logs(job_id))


@app.command()
def status(job_id: str = JobArgument, address: str = Address) -> None:
    """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED, with Ray's message (exit 0 for any)."""
    from govray.platform.submission import RayJobs

    console.print(_status_line(RayJobs.connect(address).info(job_id)), highlight=False)


@app.command()
def stop(
    job_id: str = JobArgument,
    address: str = Address,
    wait: float = typer.Option(
        60.0, "--wait", min=0.0, help="Seconds to wait for the job to end (0: only ask)."
    ),
) -> None:
    """Stop the job: Ray sends its driver SIGTERM (SIGKILL after a grace period), which ends its
    trial's workers; the trial stays interrupted, and resubmitting the experiment continues it
    from its latest checkpoint. Exit 0 once the job has ended, 20 if it still runs after --wait."""
    from govray.platform.submission import TERMINAL, JobError, RayJobs

    jobs = RayJobs.connect(address)
    if not jobs.stop(job_id):
        console.print(f"{_status_line(jobs.info(job_id))} (nothing to stop)", highlight=False)
        return
    if not wait:
        console.print(f"stop requested for job {job_id}", highlight=False)
        return
    if jobs.wait(job_id, timeout=wait) not in TERMINAL:
        still = jobs.info(job_id).status.value
        raise JobError(f"job {job_id} is still {still} {wait:g} s after the stop request")
    console.print(_status_line(jobs.info(job_id)), highlight=False)


@app.command(name="list")
def list_jobs(address: str = Address) -> None:
    """The cluster's jobs, newest first: id, status, experiment, start time."""
    from govray.platform.submission import RayJobs

    shown = table("job", "status", "experiment", "entrypoint", "started (UTC)")
    found = sorted(RayJobs.connect(address).jobs(), key=lambda job: job.start_time or 0, reverse=True)
    for job in found:
        started = datetime.fromtimestamp(job.start_time / 1000, UTC) if job.start_time else None
        shown.add_row(
            job.submission_id or job.job_id or "",
            job.status.value,
            (job.metadata or {}).get("experiment", ""),
            job.entrypoint,
            started.strftime("%Y-%m-%d %H:%M:%S") if started else "",
        )
    console.print(shown)


@app.command(name="verify-pins")
def verify_pins_command() -> None:
    """Check this machine's packages against the pins a submitted job carries (exit 22 when they
    differ); ``govray job train`` and ``govray job search`` run it first."""
    from govray.platform.submission import verify_pins

    checked = verify_pins()
    if checked:
        console.print(f"packages match the submission's {checked} pins", highlight=False)


JobConfig = typer.Option(
    ..., "--config", help="The experiment file (YAML), relative to the job's working dir."
)


@app.command(name="train")
def train_job(config: Path = JobConfig, allow_unsigned_policy: bool = AllowUnsigned) -> None:
    """A submitted job's entry point: check this node's packages against the job's pins (exit 22),
    then run the experiment (``govray run CONFIG --resume-interrupted``: a resubmitted job
    continues the trial its dead driver left behind)."""
    from govray.cli import main

    flags = ["--allow-unsigned-policy"] if allow_unsigned_policy else []
    raise typer.Exit(
        main(["job", "verify-pins"]) or main(["run", str(config), "--resume-interrupted", *flags])
    )


@app.command(name="search")
def search_job(config: Path = JobConfig, allow_unsigned_policy: bool = AllowUnsigned) -> None:
    """A submitted search job's entry point: check this node's packages against the job's pins
    (exit 22), then run the search (``govray search CONFIG``; resubmitted, it resumes)."""
    from govray.cli import main

    flags = ["--allow-unsigned-policy"] if allow_unsigned_policy else []
    raise typer.Exit(main(["job", "verify-pins"]) or main(["search", str(config), *flags]))
