"""``govray data ingest``."""

from __future__ import annotations

from pathlib import Path

import typer

from govray.cli.common import AllowUnsigned, ConfigArgument, Strict, console, open_experiment, table, warn

app = typer.Typer(help="Ingest credentialed corpora into route-partitioned shards.", no_args_is_help=True)


@app.command()
def ingest(
    config_path: Path = ConfigArgument,
    allow_unsigned: bool = AllowUnsigned,
    force: bool = typer.Option(False, "--force", help="Rewrite shards even if identical ones exist."),
    strict: bool = Strict,
) -> None:
    """Validate every row's credential, fingerprint each corpus and write route-partitioned shards."""
    from govray.platform.run.preflight import check_policy, ingest_experiment

    config, store = open_experiment(config_path)
    checked = check_policy(config, store, allow_unsigned=allow_unsigned)
    experiment, result = ingest_experiment(config, checked, store, force=force, strict=strict, warn=warn)
    manifest = result.manifest
    verb = "reused" if result.reused else "wrote"
    console.print(
        f"experiment {experiment.id} '{experiment.name}': {verb} shards {result.root} "
        f"(row hash v{manifest.row_hash_version})"
    )
    corpora = table("corpus", "role", "rows", "train", "holdout", "training rows per route")
    for corpus in manifest.corpora:
        routes = ", ".join(f"{route}={count}" for route, count in sorted(corpus.route_counts.items()))
        corpora.add_row(
            corpus.corpus_id,
            corpus.role,
            str(corpus.rows),
            str(corpus.train_rows),
            str(corpus.holdout_rows),
            routes or "-",
        )
    console.print(corpora)
    for corpus in manifest.corpora:
        console.print(f"fingerprint {corpus.corpus_id} sha256:{corpus.fingerprint}", highlight=False)
    by_route = table("route", "training rows", "files")
    for route in manifest.routes:
        by_route.add_row(route.route, str(route.rows), str(len(route.files)))
    console.print(by_route)
