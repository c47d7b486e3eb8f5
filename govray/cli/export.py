"""``govray export eu-summary MODEL[:VERSION]``: the EU AI Act training-content summary.
``govray export bom MODEL[:VERSION] --format cyclonedx``: a CycloneDX 1.6 ML-BOM.
``govray export peft-adapter MODEL[:VERSION] --adapter NAME --out DIR``: an adapter in PEFT's layout."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from govray.cli.common import Database, database_url, open_store
from govray.tracking.lineage import trial_of
from govray.tracking.store import TrackingStore

if TYPE_CHECKING:
    from govray.platform.registry.versions import RegisteredVersion
    from govray.provenance.eu_summary import EuSummary, Period

app = typer.Typer(help="Export documents for reviewers and regulators.", no_args_is_help=True)


class Format(StrEnum):
    MD = "md"
    JSON = "json"


class BomFormat(StrEnum):
    CYCLONEDX = "cyclonedx"


@app.command("eu-summary")
def eu_summary_command(
    model: str | None = typer.Argument(
        None, metavar="MODEL[:VERSION]", help="A registered model (its latest version without :VERSION)."
    ),
    checkpoint: Path | None = typer.Option(
        None, "--checkpoint", help="Summarise this checkpoint directory instead of a registered model."
    ),
    output: Format = typer.Option(Format.MD, "--format", help="md (Markdown) or json."),
    provider: str = typer.Option("", "--provider", help="The provider's name, for section 1."),
    database: str | None = Database,
) -> None:
    """The training-content summary of a model version (template sections: general information,
    data sources by type, data processing), from its credentials, shards and recorded schedule.
    Exits 17 for an unknown model or version."""
    from govray.platform.registry.versions import resolve
    from govray.provenance.eu_summary import eu_summary

    if (model is None) == (checkpoint is None):
        raise typer.BadParameter("give either MODEL[:VERSION] or --checkpoint DIR")
    url = database_url(database)
    store = TrackingStore.open(url) if url else None
    if model is not None:
        if store is None:
            store = open_store(None)  # refused, saying where a store may be named
        summary = version_summary(store, resolve(store, model), provider)
    else:
        assert checkpoint is not None
        summary = eu_summary(
            checkpoint,
            model=checkpoint.resolve().parent.name,
            version=checkpoint.name,
            trial=trial_of(store, checkpoint) if store is not None else None,
            provider=provider,
        )
    typer.echo(summary.model_dump_json(indent=2) if output == Format.JSON else to_markdown(summary))


@app.command("bom")
def bom_command(
    model: str = typer.Argument(
        ..., metavar="MODEL[:VERSION]", help="A registered model (its latest version without :VERSION)."
    ),
    output: BomFormat = typer.Option(BomFormat.CYCLONEDX, "--format", help="cyclonedx (CycloneDX 1.6 JSON)."),
    database: str | None = Database,
) -> None:
    """An ML-BOM of a model version: the model (every file's sha256, policy, adapters, removed
    adapters), each corpus as a data component (credential, fingerprint, examples that reached the
    model), dependencies from its provenance attestation. Exits 17 for an unknown model or version."""
    from govray.platform.registry.versions import envelope_sha256, provenance_record, resolve
    from govray.provenance.bom import cyclonedx_bom
    from govray.queries.ledger_rows import statement_of

    store = open_store(database)
    version = resolve(store, model)
    record = provenance_record(store, version)
    document = cyclonedx_bom(
        version.directory,
        version_summary(store, version),
        statement_of(record.envelope_json),
        model_uri=version.uri,
        removed_adapters=version.removed_adapters,
        attestation_sha256=envelope_sha256(record),
    )
    typer.echo(json.dumps(document, indent=2))


def version_summary(store: TrackingStore, version: RegisteredVersion, provider: str = "") -> EuSummary:
    """The training-content summary of a registered version."""
    from govray.provenance.eu_summary import eu_summary

    return eu_summary(
        version.directory,
        model=version.model,
        version=str(version.version),
        excluded_corpora=version.excluded_corpora,
        trial=store.get_trial(version.checkpoint.trial_id),
        provider=provider,
    )


@app.command("peft-adapter")
def peft_adapter_command(
    model: str | None = typer.Argument(
        None, metavar="MODEL[:VERSION]", help="A registered model (its latest version without :VERSION)."
    ),
    adapter: str = typer.Option(..., "--adapter", help="The adapter to export (a name in the run's policy)."),
    out: Path = typer.Option(
        ..., "--out", help="Directory for adapter_config.json and adapter_model.safetensors."
    ),
    trust: Path = typer.Option(..., "--trust", help="Trust file listing the platform keys to accept."),
    checkpoint: Path | None = typer.Option(
        None, "--checkpoint", help="Export from this checkpoint directory instead of a registered model."
    ),
    database: str | None = Database,
) -> None:
    """Write ADAPTER of a verified model version in PEFT's layout, so that
    ``PeftModel.from_pretrained(base, OUT)`` loads what govray trained. Exits 9 for an unknown
    adapter, 17 for an unknown model or version."""
    from govray.core.keys import load_trust
    from govray.platform.registry.peft_export import export_peft_adapter
    from govray.platform.registry.versions import resolve

    if (model is None) == (checkpoint is None):
        raise typer.BadParameter("give either MODEL[:VERSION] or --checkpoint DIR")
    if model is not None:
        checkpoint = resolve(open_store(database), model).directory
    assert checkpoint is not None
    written = export_peft_adapter(checkpoint, adapter, out, load_trust(trust))
    typer.echo(f"{adapter}: {written} (PeftModel.from_pretrained(base, '{written}'))")


def to_markdown(summary: EuSummary) -> str:
    """The summary as a Markdown document, section by section."""
    from govray.governance.policy import UNSIGNED_POLICY

    g, p = summary.general, summary.processing
    signed = (
        "UNSIGNED: nobody vouched for it"
        if g.policy_signer == UNSIGNED_POLICY
        else f"signed by {g.policy_signer}"
    )
    lines = [
        f"# Training-content summary: {g.model} version {g.version}",
        "",
        "## 1. General information",
        f"- Model: {g.model} version {g.version} (base model sha256 {g.base_model_sha256})",
        f"- Provider: {g.provider or 'not stated'}; trained with {g.platform}",
        f"- Adapters: {', '.join(g.adapters) or 'none'}",
        f"- Started from: {g.started_from or 'random initialisation'}",
        f"- Depth policy: {g.policy} (sha256 {g.policy_sha256}), {signed}",
        f"- Modalities: {', '.join(g.modalities) or 'none'}",
        f"- Data collected: {g.collection_period.start} to {g.collection_period.end}",
        f"- Trained: {_when(g.training_period)}, {g.step} steps",
        f"- Size: {g.corpora} corpora, {g.rows} rows ({g.train_rows} for training, {g.holdout_rows} held "
        f"out); {g.examples} examples reached the model",
        "",
        "## 2. List of data sources",
    ]
    for group in summary.sources:
        lines += ["", f"### {group.title}", ""]
        if not group.corpora:
            lines.append("None.")
            continue
        lines += [
            "| corpus | provider | license | jurisdiction | sensitivity | modality | TDM opt-out | "
            "collected | rows | examples in model |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {c.corpus_id} | {_cell(c.provider or '-')} | {c.license_class} | "
            f"{', '.join(c.jurisdictions)} | {', '.join(c.sensitivities)} | {c.modality} | "
            f"{'yes' if c.tdm_opt_out else 'no'} | "
            f"{c.collection_period.start} to {c.collection_period.end} | {c.rows} | {c.examples} |"
            for c in group.corpora
        ]
        lines += [f"- Web domain {domain}: {', '.join(corpora)}" for domain, corpora in group.domains.items()]
    lines += ["", "## 3. Data processing", "", "### Text-and-data-mining opt-outs", ""]
    lines += [
        f"- {o.corpus_id}: {'honoured' if o.honoured else 'not withheld'}: {o.how}" for o in p.tdm_opt_outs
    ]
    lines += ["- None expressed."] if not p.tdm_opt_outs else []
    lines += ["", "### Sensitive data", "", "| sensitivity | corpus | route | may update | rows | in model |"]
    lines += ["|---|---|---|---|---|---|"]
    lines += [
        f"| {s.sensitivity} | {s.corpus_id} | {_cell(s.route)} | {_cell(s.updates)} | {s.rows} | "
        f"{'yes' if s.in_model else 'no'} |"
        for s in p.sensitive_data
    ]
    lines += ["", "### Excluded corpora", ""]
    lines += [f"- {corpus}: {why}" for corpus, why in p.excluded_corpora.items()] or ["- None."]
    lines += ["", "### Memorization checks (last validation)", ""]
    lines += [
        f"- {m.corpus_id}: {'flagged' if m.flagged else 'not flagged'}; "
        + "; ".join(
            f"{name} {value:.4g} ({_threshold(m.thresholds[name])})" for name, value in m.measures.items()
        )
        for m in p.memorization
    ] or ["- None measured."]
    lines += ["", f"Contribution counted: {p.contribution}.", ""]
    return "\n".join(lines)


def _threshold(limit: float | None) -> str:
    return "reported, flags nothing" if limit is None else f"threshold {limit:g}"


def _when(period: Period | None) -> str:
    if period is None:
        return "period not recorded"
    return f"{period.start} to {period.end or 'ongoing'}"


def _cell(text: str) -> str:
    """Text fit for a Markdown table cell (a pipe would end the cell)."""
    return text.replace("|", "\\|").replace("\n", " ")
