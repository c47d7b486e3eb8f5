"""The ``govray`` command line (``python -m govray`` is the same).

Exit codes: 0 success; 2 bad experiment file, or a missing or invalid argument or option; 3 bad
credential (also a row's); 4 bad policy (also a row matching no rule); 5 signature refused; 6
routing refused; 7 ingest refused; 8 tracking store problem; 10 checkpoint refused; 16 attestation
refused (it names what broke); 17 model registry request refused; 18 row lookup refused (unknown
corpus, row out of range); 19 training-content summary refused; 20 Ray job failed, or the Ray Jobs
API refused a request (address, token, unknown job); 21 Ray job stopped before it finished; 22 a
submitted job's packages differ from its pins; 23 the run does not fit the GPU memory given to
``govray plan``; 1 anything else govray refused on purpose.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from govray.cli import audit, data, experiment, export, job, keys, lineage, model, policy, trial
from govray.cli.attest import attest, verify
from govray.cli.plan import plan
from govray.cli.replay import replay
from govray.cli.resume import resume
from govray.cli.run import run
from govray.cli.search import search
from govray.cli.serve import serve
from govray.core.errors import GovrayError

app = typer.Typer(
    name="govray",
    help="Governed deep-learning training on Ray.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(policy.app, name="policy")
app.add_typer(data.app, name="data")
app.add_typer(experiment.app, name="experiment")
app.add_typer(experiment.app, name="experiments", hidden=True)  # its earlier name, kept for scripts
app.add_typer(trial.app, name="trial")
app.add_typer(audit.app, name="audit")
app.add_typer(keys.app, name="keys")
app.add_typer(model.app, name="model")
app.add_typer(lineage.app, name="lineage")
app.add_typer(export.app, name="export")
app.add_typer(job.app, name="job")
app.command(name="run")(run)
app.command(name="search")(search)
app.command(name="serve")(serve)
app.command(name="submit")(job.submit)
app.command(name="replay")(replay)
app.command(name="resume")(resume)
app.command(name="attest")(attest)
app.command(name="verify")(verify)
app.command(name="plan")(plan)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; a ``GovrayError`` or a usage error becomes one red line and its exit code."""
    errors = Console(stderr=True, soft_wrap=True)
    try:
        app(args=argv, standalone_mode=False)
    except GovrayError as error:
        errors.print(f"[bold red]{type(error).__name__}:[/] {escape(str(error))}", highlight=False)
        return error.exit_code
    except typer.TyperException as error:  # a missing or invalid argument or option: exit 2
        errors.print(f"[bold red]usage:[/] {escape(error.format_message())}", highlight=False)
        return error.exit_code
    except typer.Exit as done:
        return int(done.exit_code or 0)
    except (typer.Abort, KeyboardInterrupt):
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
