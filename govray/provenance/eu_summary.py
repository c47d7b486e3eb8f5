"""The EU AI Act training-content summary of a model, from credentials, shards and the schedule.

Sections follow the Commission's template for the public summary of training content:

1. **General information**: the model and version, provider and platform, the policy it was
   trained under, modalities, collection and training periods, overall sizes;
2. **List of data sources** by type (public datasets, licensed private data, crawled data — by
   web domain where the credential names them —, user data, synthetic data, other), each corpus
   with its credential, rows and the examples that reached the model;
3. **Data processing**: text-and-data-mining opt-outs and what became of those corpora, how each
   sensitivity class was routed (all layers, some layers, a removable adapter), excluded corpora.

Counts are exact: rows and per-row credentials come from the ingest's shards, examples from the
recorded schedule (every slot of every step the weights still hold, per corpus and route). An
example counts towards the published model only if its route's tensors are in it: a version whose
adapter was removed holds nothing of that adapter's route.

Example::

    summary = eu_summary(checkpoint_dir, model="digits", version="2", excluded_corpora=("digits-writers",))
    print(to_markdown(summary))      # or summary.model_dump_json(indent=2)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from govray.core.errors import AttestationError, GovrayError
from govray.core.keys import TrustConfig
from govray.core.settings import operator_trust
from govray.core.version import GOVRAY_VERSION
from govray.data.schedule import ScheduleSpec
from govray.data.shards import CorpusSummary, ShardSet
from govray.data.slots import step_slots
from govray.governance.credentials import Credential, SourceType
from govray.governance.policy import AdapterRoute, Route
from govray.governance.routing import RoutingTable
from govray.provenance.locations import run_spec_of
from govray.provenance.row_reach import route_tensors
from govray.tracking.tables import TrialRecord
from govray.train.checkpoints.files import load_checkpoint
from govray.train.checkpoints.whole_file import base_sha256

SOURCE_TITLES = {
    SourceType.PUBLIC_DATASET: "Publicly available datasets",
    SourceType.LICENSED_PRIVATE: "Private datasets licensed from third parties",
    SourceType.CRAWLED: "Data crawled and scraped from online sources",
    SourceType.USER_DATA: "User data",
    SourceType.SYNTHETIC: "Synthetic data",
    SourceType.OTHER: "Other sources",
}

CONTRIBUTION = (
    "direct: an example counts where its gradient reached the updates of the model's tensors, as "
    "scheduled; layers below those it updated are influenced only indirectly"
)


class SummaryError(GovrayError):
    """A training-content summary cannot be built (the message says what is missing)."""

    exit_code = 19


class _Document(BaseModel):
    model_config = ConfigDict(frozen=True)


class Period(_Document):
    start: str  # ISO dates
    end: str | None  # None: not ended


class GeneralInformation(_Document):
    model: str
    version: str
    provider: str
    platform: str
    checkpoint: str
    step: int  # global training steps
    base_model_sha256: str
    adapters: list[str]  # the adapter files this version holds
    started_from: str | None  # the checkpoint a fine-tuning run started from
    policy: str  # name and version of the depth policy
    policy_sha256: str
    policy_signer: str  # the policy envelope's signer keyid, or "unsigned" (the operator let it through)
    modalities: list[str]  # of the data that reached the model
    collection_period: Period
    training_period: Period | None  # the trial's start and end, when the tracking store knows them
    corpora: int
    rows: int
    train_rows: int
    holdout_rows: int
    examples: int  # that reached the published model (repeats across epochs count)


class CorpusSource(_Document):
    """One corpus: its credential (per-row fields as found in its rows) and sizes."""

    corpus_id: str
    role: str  # train, or an evaluation role (no example of it trains)
    source_type: str
    modality: str
    provider: str | None
    description: str
    license_class: str
    jurisdictions: list[str]
    sensitivities: list[str]
    tdm_opt_out: bool  # a rights reservation was expressed (for any of its rows)
    domains: list[str]
    collection_period: Period
    credential: dict[str, Any]  # the corpus-level credential as ingested
    credential_columns: dict[str, str]  # per-row credential fields → their columns
    fingerprint: str
    rows: int
    train_rows: int
    holdout_rows: int
    route_rows: dict[str, int]  # training rows per route
    trained_examples: int  # examples its rows gave the training run
    examples: int  # of those, the ones in the published model
    excluded: str  # why it is not in the published model; "" when it is


class SourceGroup(_Document):
    source_type: str
    title: str
    corpora: list[CorpusSource]
    rows: int
    examples: int
    domains: dict[str, list[str]]  # crawled data: web domain → corpora


class OptOut(_Document):
    corpus_id: str
    examples: int
    honoured: bool  # none of its examples is in the published model
    how: str


class SensitiveRoute(_Document):
    sensitivity: str
    corpus_id: str
    route: str
    updates: str  # "all layers", "layers hidden, head", "adapter pii-lora (removable)"
    rows: int
    in_model: bool


class MemorizationCheck(_Document):
    """One corpus at the checkpoint's last validation: each memorization measure that ran, its
    value and its threshold (None: reported, raises no flag), and whether it was flagged."""

    corpus_id: str
    measures: dict[str, float]
    thresholds: dict[str, float | None]
    flagged: bool


class DataProcessing(_Document):
    tdm_opt_outs: list[OptOut]
    sensitive_data: list[SensitiveRoute]
    excluded_corpora: dict[str, str]  # corpus → why
    memorization: list[MemorizationCheck] = []
    contribution: str = CONTRIBUTION


class EuSummary(_Document):
    """The three sections of the template."""

    general: GeneralInformation
    sources: list[SourceGroup]
    processing: DataProcessing


def eu_summary(
    checkpoint: Path,
    *,
    model: str,
    version: str,
    excluded_corpora: Sequence[str] = (),
    trial: TrialRecord | None = None,
    provider: str = "",
    trust: TrustConfig | None = None,
) -> EuSummary:
    """The summary of the model in ``checkpoint`` (a checkpoint or a registered version's sealed
    directory; verified first). ``excluded_corpora``: those the registry left out of this version;
    ``trial``: the trial that trained it, for the training period."""
    if not checkpoint.is_dir():
        raise SummaryError(f"{checkpoint}: no such checkpoint or model version directory")
    try:
        spec = run_spec_of(checkpoint)
    except AttestationError as error:
        raise SummaryError(str(error)) from None
    trust = trust if trust is not None else operator_trust()
    state = load_checkpoint(checkpoint, trust).state
    adapters = sorted(
        path.name.removeprefix("adapter-").removesuffix(".safetensors")
        for path in checkpoint.glob("adapter-*.safetensors")
    )
    schedule = ScheduleSpec.from_json(state.schedule)
    shards = ShardSet.open(Path(spec.shard_root))
    routes = spec.policy.routes()
    in_model = {
        key: not isinstance(route, AdapterRoute) or route.adapter in adapters for key, route in routes.items()
    }
    routing = spec.routing
    updates = {key: _updates(routing, key, route) for key, route in routes.items()}
    trained = _trained_examples(schedule, state.step)
    rows = _row_credentials(shards)
    excluded = _exclusions(schedule, excluded_corpora, in_model, shards)
    corpora = [
        _source(summary, rows.get(summary.corpus_id, Counter()), trained, in_model, excluded)
        for summary in shards.manifest.corpora
    ]
    general = GeneralInformation(
        model=model,
        version=version,
        provider=provider,
        platform=f"govray {GOVRAY_VERSION} on Ray",
        checkpoint=str(checkpoint),
        step=state.step,
        base_model_sha256=base_sha256(checkpoint, trust),  # (a sharded one's: put together, streaming)
        adapters=adapters,
        started_from=str(state.source["path"]) if state.source.get("path") else None,
        policy=f"{spec.policy.name} v{spec.policy.version}",
        policy_sha256=spec.policy_digest,
        policy_signer=spec.policy_signer,
        **_periods_and_totals(corpora, trial),
    )
    processing = DataProcessing(
        tdm_opt_outs=[_opt_out(corpus, updates) for corpus in corpora if corpus.tdm_opt_out],
        sensitive_data=_sensitive_data(rows, updates, in_model, excluded),
        excluded_corpora=excluded,
        memorization=_memorization_checks(state.memorization),
    )
    return EuSummary(general=general, sources=_groups(corpora), processing=processing)


def _periods_and_totals(corpora: list[CorpusSource], trial: TrialRecord | None) -> dict[str, Any]:
    """What the corpora and the trial give the general information: modalities, the periods of
    collection and training, and the totals."""
    return {
        "modalities": sorted({c.modality for c in corpora if c.examples}),
        "collection_period": Period(
            start=min(c.collection_period.start for c in corpora),
            end=max(c.collection_period.end or c.collection_period.start for c in corpora),
        ),
        "training_period": None
        if trial is None
        else Period(
            start=trial.created_at.date().isoformat(),
            end=trial.ended_at.date().isoformat() if trial.ended_at else None,
        ),
        "corpora": len(corpora),
        "rows": sum(c.rows for c in corpora),
        "train_rows": sum(c.train_rows for c in corpora),
        "holdout_rows": sum(c.holdout_rows for c in corpora),
        "examples": sum(c.examples for c in corpora),
    }


def _sensitive_data(
    rows: dict[str, _Rows], updates: dict[str, str], in_model: dict[str, bool], excluded: dict[str, str]
) -> list[SensitiveRoute]:
    """Per (sensitivity, corpus, route): the rows and what they updated, and whether it is in the model."""
    return [
        SensitiveRoute(
            sensitivity=sensitivity,
            corpus_id=corpus_id,
            route=route,
            updates=updates[route],
            rows=count,
            in_model=in_model[route] and corpus_id not in excluded,
        )
        for (sensitivity, corpus_id, route), count in sorted(_sensitive_rows(rows).items())
    ]


_Rows = Counter[tuple[str, str | None]]  # (credential JSON, route; None: held out) → rows


def _memorization_checks(report: dict[str, Any]) -> list[MemorizationCheck]:
    """The last ``MemorizationReport`` of the checkpoint (empty before a first validation), per
    corpus: the measures that ran."""
    thresholds = report.get("thresholds", {})
    checks = []
    for corpus_id, verdict in sorted(report.get("corpora", {}).items()):
        measures = {name: value for name, value in verdict["measures"].items() if value is not None}
        checks.append(
            MemorizationCheck(
                corpus_id=corpus_id,
                measures=measures,
                thresholds={name: thresholds.get(name) for name in measures},
                flagged=verdict["flagged"],
            )
        )
    return checks


def _trained_examples(schedule: ScheduleSpec, steps: int) -> Counter[tuple[str, str]]:
    """Examples per (corpus, route) over the steps the weights hold (a rollback's are not)."""
    counts: Counter[tuple[str, str]] = Counter()
    for global_step in (step for step in range(steps) if not schedule.reverted(step)):
        for item in step_slots(schedule, global_step):
            counts.update((corpus, item.route or "") for corpus in item.corpora)  # an empty slot: none
    return counts


def _row_credentials(shards: ShardSet) -> dict[str, _Rows]:
    """Per corpus, its rows by (full per-row credential, route), read from the shards."""
    columns = ["_corpus", "_credential"]
    tables: list[tuple[str | None, pa.Table]] = [
        (r.route, shards.route_table(r.route, columns)) for r in shards.manifest.routes if r.rows
    ]
    tables += [(None, shards.holdout_table(corpus, columns)) for corpus in shards.manifest.holdout]
    found: dict[str, _Rows] = {}
    for route, table in tables:
        for group in table.group_by(columns).aggregate([("_corpus", "count")]).to_pylist():
            found.setdefault(group["_corpus"], Counter())[group["_credential"], route] += group[
                "_corpus_count"
            ]
    return found


def _source(
    summary: CorpusSummary,
    rows: _Rows,
    trained: Counter[tuple[str, str]],
    in_model: dict[str, bool],
    excluded: dict[str, str],
) -> CorpusSource:
    credentials = [Credential.model_validate_json(text) for text in sorted({text for text, _ in rows})]
    if not credentials:
        raise SummaryError(f"shards hold no row of corpus '{summary.corpus_id}'")
    first = credentials[0]
    mine = {route: n for (corpus, route), n in trained.items() if corpus == summary.corpus_id}
    reached = 0 if summary.corpus_id in excluded else sum(n for r, n in mine.items() if in_model[r])
    return CorpusSource(
        corpus_id=summary.corpus_id,
        role=summary.role,
        source_type=first.source_type.value,
        modality=first.modality.value,
        provider=first.provider,
        description=first.description,
        license_class=first.license_class.value,
        jurisdictions=sorted({c.jurisdiction for c in credentials}),
        sensitivities=sorted({c.sensitivity.value for c in credentials}),
        tdm_opt_out=any(c.tdm_opt_out for c in credentials),
        domains=sorted({domain for c in credentials for domain in c.domains}),
        collection_period=Period(
            start=min(c.collection_period.start for c in credentials).isoformat(),
            end=max(c.collection_period.end for c in credentials).isoformat(),
        ),
        credential=summary.credential,
        credential_columns=summary.credential_columns,
        fingerprint=summary.fingerprint,
        rows=summary.rows,
        train_rows=summary.train_rows,
        holdout_rows=summary.holdout_rows,
        route_rows=summary.route_counts,
        trained_examples=sum(mine.values()),
        examples=reached,
        excluded=excluded.get(summary.corpus_id, ""),
    )


def _exclusions(
    schedule: ScheduleSpec,
    registry: Sequence[str],
    in_model: dict[str, bool],
    shards: ShardSet,
) -> dict[str, str]:
    """Corpora not in the published model, and why."""
    why = {corpus: "excluded from the training run" for corpus in schedule.excluded_corpora}
    for summary in shards.manifest.corpora:
        if summary.route_counts and not any(in_model[route] for route in summary.route_counts):
            routes = ", ".join(summary.route_counts)
            why.setdefault(summary.corpus_id, f"this version lacks the adapter of its route {routes}")
    for corpus in registry:
        why.setdefault(corpus, "left out of this model version by the registry")
    return dict(sorted(why.items()))


def _updates(routing: RoutingTable, key: str, route: Route) -> str:
    """What a route's examples may update, in words."""
    if route == "all":
        return "all layers"
    if isinstance(route, AdapterRoute):
        return f"only the removable adapter {route.adapter}"
    return f"only layers {', '.join(route_tensors(routing, key)[1])}"


def _opt_out(corpus: CorpusSource, updates: dict[str, str]) -> OptOut:
    if corpus.excluded:
        how = f"not in this model: {corpus.excluded}"
    elif not corpus.examples:
        how = "no example reached this model"
    else:
        routes = "; ".join(f"{route}: {updates[route]}" for route in corpus.route_rows)
        how = f"used under license class {corpus.license_class}, routed to {routes}"
    return OptOut(corpus_id=corpus.corpus_id, examples=corpus.examples, honoured=not corpus.examples, how=how)


def _sensitive_rows(rows: dict[str, _Rows]) -> Counter[tuple[str, str, str]]:
    """Training rows per (sensitivity, corpus, route)."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for corpus, found in rows.items():
        for (text, route), count in found.items():
            if route is not None:
                counts[Credential.model_validate_json(text).sensitivity.value, corpus, route] += count
    return counts


def _groups(corpora: list[CorpusSource]) -> list[SourceGroup]:
    groups = []
    for kind, title in SOURCE_TITLES.items():
        mine = [corpus for corpus in corpora if corpus.source_type == kind.value]
        names = sorted({domain for corpus in mine for domain in corpus.domains})
        domains = {name: [c.corpus_id for c in mine if name in c.domains] for name in names}
        groups.append(
            SourceGroup(
                source_type=kind.value,
                title=title,
                corpora=mine,
                rows=sum(c.rows for c in mine),
                examples=sum(c.examples for c in mine),
                domains=domains,
            )
        )
    return groups
