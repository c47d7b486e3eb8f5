"""The ``govray`` command line (``python -m govray`` is the same).

Exit codes: 0 success; 2 bad experiment file; 3 bad credential; 4 bad policy; 5 signature
refused; 6 routing refused; 7 ingest refused; 8 tracking store problem; 1 anything else govray
refused on purpose.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from govray.cli import data, experiments, policy
from govray.cli.replay import replay
from govray.cli.resume import resume
from govray.cli.run import run
from govray.errors import GovrayError

app = typer.Typer(
    name="govray",
    help="Governed deep-learning training on Ray.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(policy.app, name="policy")
app.add_typer(data.app, name="data")
app.add_typer(experiments.app, name="experiments")
app.command(name="run")(run)
app.command(name="replay")(replay)
app.command(name="resume")(resume)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; a ``GovrayError`` becomes one red line and its exit code."""
    try:
        app(args=argv, standalone_mode=False)
    except GovrayError as error:
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]{type(error).__name__}:[/] {error}", highlight=False
        )
        return error.exit_code
    except typer.Exit as done:
        return int(done.exit_code or 0)
    except (typer.Abort, KeyboardInterrupt):
        return 130
    except Exception as error:  # click's usage errors
        import click

        if isinstance(error, click.ClickException):
            error.show()
            return error.exit_code
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
