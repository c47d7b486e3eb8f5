"""The ``govray`` command line (``python -m govray`` is the same).

Exit codes: 0 success; 2 bad experiment file, or a missing or invalid argument or option; 3 bad
credential (also a row's); 4 bad policy (also a row matching no rule); 5 signature refused; 6
routing refused; 7 ingest refused; 8 tracking store problem; 10 checkpoint refused; 16 attestation
refused (it names what broke); 17 model registry request refused; 18 row lookup refused (unknown
corpus, row out of range); 19 training-content summary refused; 20 Ray job failed, or the Ray Jobs
API refused a request (address, token, unknown job); 21 Ray job stopped before it finished; 22 a
submitted job's packages differ from its pins; 23 the run does not fit the GPU memory given to
``govray plan``; 24 ``govray up`` could not start the Ray head; 1 anything else govray refused on
purpose.

A command that needs Ray joins the one running on this machine (``govray up``, ``ray start
--head``, ``RAY_ADDRESS``) and says so in one line, else starts its own; Ray's loggers write to a
file that a refusal names, never to the terminal (``govray.core.rayhead``, ``govray.core.raylogs``).

A subcommand's module is imported only when that subcommand runs (``lazy.py``), and imports what
reaches torch, Ray or pyarrow inside the commands that use it: ``govray --help``, every command's
``--help`` and the commands that only read the tracking store start in about a second
(``tests/test_cli_imports.py``, ``jobs/benchmarks/cli_latency.py``).
"""

from __future__ import annotations

import sys

import typer
import typer.main
from rich.console import Console
from rich.markup import escape

from govray.cli.lazy import LazyGroup, Subcommand
from govray.core.errors import GovrayError
from govray.core.raylogs import ray_log_file

# Every subcommand, in the order `govray --help` lists them, with the first paragraph of its help:
# the listing imports none of them (tests/test_cli_imports.py checks each summary against its help).
SUBCOMMANDS = {
    "run": Subcommand(
        "govray.cli.run:run", "Verify the policy, ingest, and train the experiment's trial under governance."
    ),
    "search": Subcommand(
        "govray.cli.search:search",
        "Verify, ingest, and search the hyperparameter space (every trial governed and recorded).",
    ),
    "serve": Subcommand(
        "govray.cli.serve:serve",
        "Serve lineage, influence, row lookups, audit events and attestations over HTTP (JSON API\n"
        "under /api, OpenAPI at /openapi.json). The write token comes from serve.token in\n"
        "GOVRAY_HOME/config.yaml, GOVRAY_SERVE_TOKEN or the config, never the command line.",
    ),
    "submit": Subcommand(
        "govray.cli.job:submit",
        "Run the experiment as a Ray job on the cluster (govray job train, or govray job search).",
    ),
    "replay": Subcommand(
        "govray.cli.replay:replay",
        "Rerun a recorded trial with the corpus's schedule slots empty; report its influence.",
    ),
    "resume": Subcommand(
        "govray.cli.resume:resume",
        "Resume the experiment's interrupted (or paused) trial under its own Ray Train run name; an\n"
        "experiment that ran a search resumes its search where Ray Tune left off.",
    ),
    "attest": Subcommand(
        "govray.cli.attest:attest",
        "Verify the checkpoint (under the operator's trust; its manifest the one the tracking store\n"
        "recorded when it was sealed), then write its provenance and coverage statements, made and signed\n"
        "by the platform's signer (this process holds no key), under STORAGE/attestations/RUN/ (and,\n"
        "with --model-signing, an OpenSSF model signature that ``model_signing verify key`` checks).",
    ),
    "verify": Subcommand(
        "govray.cli.attest:verify",
        "Check the signature (trusted, unrevoked key), every subject digest against the files, and\n"
        "optionally the policy and the ledger; exits non-zero naming what broke. A model signature is\n"
        "checked by ``model_signing``'s own verifier: every file of the directory, none more.",
    ),
    "plan": Subcommand(
        "govray.cli.plan:plan",
        "Print each rank's peak memory (params, grads, optimizer state, activations, governance and\n"
        "communication buffers) for one step of the experiment's first trial; refuse a run that cannot fit.",
    ),
    "up": Subcommand(
        "govray.cli.head:up",
        "Start a local Ray head that every later command joins (until ``govray down``), so each\n"
        "command pays Ray's start once; a no-op when one is running.",
    ),
    "down": Subcommand(
        "govray.cli.head:down",
        "Stop the Ray head ``govray up`` started (and nothing else: other Ray instances on this\n"
        "machine keep running); a no-op when none is running.",
    ),
    "policy": Subcommand("govray.cli.policy:app", "Manage signed depth policies."),
    "data": Subcommand("govray.cli.data:app", "Ingest credentialed corpora into route-partitioned shards."),
    "experiment": Subcommand("govray.cli.experiment:app", "Experiments in the tracking store."),
    # its earlier name, kept for scripts
    "experiments": Subcommand("govray.cli.experiment:app", "Experiments in the tracking store.", hidden=True),
    "trial": Subcommand("govray.cli.trial:app", "Trials in the tracking store."),
    "audit": Subcommand("govray.cli.audit:app", "The audit log: verify its hash chain, list its events."),
    "keys": Subcommand("govray.cli.keys:app", "Signing keys of the two roles, rotation and revocation."),
    "signer": Subcommand(
        "govray.cli.signer:app",
        "The platform's signer: the one process that uses the platform's private keys.",
    ),
    "model": Subcommand(
        "govray.cli.model:app", "The model registry: versions of checkpoints, tags, adapter removal."
    ),
    "lineage": Subcommand(
        "govray.cli.lineage:app", "Lineage: what a training row reached, from the schedule."
    ),
    "export": Subcommand("govray.cli.export:app", "Export documents for reviewers and regulators."),
    "job": Subcommand("govray.cli.job:app", "Ray jobs on a cluster: logs, status, stop, list."),
    "schema": Subcommand(
        "govray.cli.schema:schema",
        "Print the JSON Schema of a file you write (experiment, policy, trust, settings, serve).",
    ),
}


class Govray(LazyGroup):
    """The ``govray`` group: its subcommands load when invoked."""

    subcommands = SUBCOMMANDS


app = typer.Typer(
    name="govray",
    help="Governed deep-learning training on Ray.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    cls=Govray,
)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; a ``GovrayError`` or a usage error becomes one red line and its exit code."""
    errors = Console(stderr=True, soft_wrap=True)
    try:
        typer.main.get_group(app).main(args=argv, standalone_mode=False)
    except GovrayError as error:
        errors.print(f"[bold red]{type(error).__name__}:[/] {escape(str(error))}", highlight=False)
        if (ray_logs := ray_log_file()) is not None:  # what Ray said meanwhile, off the terminal
            errors.print(f"[dim](Ray's logs of this command: {escape(str(ray_logs))})[/]", highlight=False)
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
