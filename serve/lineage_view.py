"""What the lineage page says about a model version or a checkpoint, gathered in one place.

- the **matrix**: per layer, the examples each corpus directly contributed (the store's ledger, as
  ``StoreReader.version_lineage`` / ``checkpoint_lineage`` aggregate it);
- each corpus's **credential** (license class, jurisdiction, sensitivity, source type), as ingested
  for the experiment;
- the **policy** the run trained under: name, version, digest and rules (from the run spec kept with
  the model files; the attested name, version and digest when that spec is gone);
- the **memorization** report signed into the provenance attestation, and the trial's latest
  ``memorization_score`` / ``memorization_flagged`` metrics;
- whether the provenance **attestation verifies** against the model files now, under the server's
  trust file (a changed byte in a weight file shows as ``FAILED`` with the reason).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from govray.core.errors import ConfigError, GovrayError, SignatureError
from govray.core.keys import load_trust
from govray.provenance.locations import signed_run_spec
from govray.queries import NotFoundError, StoreReader, Window
from govray.queries.ledger_rows import statement_of
from govray.queries.views import Lineage
from govray.tracking.tables import AttestationRecord, CorpusRecord
from serve.verify import check_envelope

CREDENTIAL_FIELDS = ("license_class", "jurisdiction", "sensitivity", "source_type")


@dataclass(frozen=True)
class CorpusColumn:
    """One corpus of the run: a column of the matrix, with its credential."""

    corpus_id: str
    credential: dict[str, str]  # CREDENTIAL_FIELDS → value ("per row" for credential columns)
    excluded: bool  # the version leaves it out (its adapter was removed)


@dataclass(frozen=True)
class PolicySummary:
    name: str
    version: str
    digest: str
    rules: list[tuple[str, str, str]]  # (rule name, what it matches, where it routes)
    signer: str  # the policy envelope's signer keyid as attested, "unsigned", or "not attested"
    note: str = ""  # why the rules are missing, when they are


@dataclass(frozen=True)
class MemorizationRow:
    corpus_id: str
    score: float
    flagged: bool
    measures: dict[str, float]


@dataclass(frozen=True)
class Memorization:
    rows: list[MemorizationRow]  # from the attested memorization report
    action: str  # what the policy says a flag does
    metrics: dict[str, float]  # the trial's latest memorization_score / memorization_flagged


@dataclass(frozen=True)
class Verification:
    verified: bool
    text: str  # "verified, signed by KEY" or "FAILED: reason"


@dataclass(frozen=True)
class LineageSheet:
    """Everything the page shows about one model version or checkpoint."""

    title: str
    facts: list[tuple[str, str]]  # label → value, in display order
    lineage: Lineage
    corpora: list[CorpusColumn]
    policy: PolicySummary
    memorization: Memorization
    verification: Verification


def version_sheet(reader: StoreReader, name: str, version: int, trust: Path | None) -> LineageSheet:
    """The sheet of model version ``name`` v``version``; NotFoundError for an unknown one."""
    view = reader.version(name, version)
    lineage = reader.version_lineage(name, version)
    checkpoint = reader.checkpoint(view.checkpoint_id)
    directory = Path(view.path or checkpoint.path)
    envelope = reader.provenance(model_version_id=view.id)
    facts = [
        ("model", f"{name} v{version}"),
        ("description", view.description),
        ("checkpoint", f"{checkpoint.id} (step {checkpoint.step}, {checkpoint.state})"),
        ("excluded corpora", ", ".join(view.excluded_corpora) or "none"),
    ]
    return _sheet(
        reader,
        f"Lineage of model {name} v{version}",
        facts,
        lineage,
        directory,
        envelope,
        trust,
        excluded=view.excluded_corpora,
    )


def checkpoint_sheet(reader: StoreReader, checkpoint_id: int, trust: Path | None) -> LineageSheet:
    """The sheet of checkpoint ``checkpoint_id``; NotFoundError for an unknown one."""
    checkpoint = reader.checkpoint(checkpoint_id)
    lineage = reader.checkpoint_lineage(checkpoint_id)
    envelope = reader.provenance(checkpoint_id=checkpoint_id)
    facts = [("checkpoint", f"{checkpoint.id} (step {checkpoint.step}, {checkpoint.state})")]
    return _sheet(
        reader,
        f"Lineage of checkpoint {checkpoint_id}",
        facts,
        lineage,
        Path(checkpoint.path),
        envelope,
        trust,
        excluded=[],
    )


def index_entries(
    reader: StoreReader, limit: int
) -> tuple[list[tuple[str, int]], list[tuple[int, int, int]]]:
    """Model versions ``(name, version)`` and each trial's last checkpoint ``(id, trial, step)``
    (the one its ledger belongs to) for the index page, newest first, at most ``limit`` of each."""
    versions = [(version.model_name, version.version) for version in reader.newest_versions(limit)]
    finals = [(c.id, c.trial_id, c.step) for c in reader.newest_final_checkpoints(limit)]
    return versions, finals


def _sheet(
    reader: StoreReader,
    title: str,
    facts: list[tuple[str, str]],
    lineage: Lineage,
    directory: Path,
    envelope: AttestationRecord | None,
    trust: Path | None,
    *,
    excluded: list[str],
) -> LineageSheet:
    statement = statement_of(envelope.envelope_json) if envelope is not None else {}
    facts = [
        *facts,
        ("trial", f"{lineage.trial_id} ({lineage.trial_state})"),
        ("lineage", lineage.as_of),  # "as of step N (running)" while the trial still trains
        ("experiment", str(lineage.experiment_id)),
        ("model files", str(directory)),
        ("attestation", f"{envelope.id} (provenance)" if envelope is not None else "none stored"),
    ]
    verification = _verify(envelope, directory, trust)
    return LineageSheet(
        title=title,
        facts=facts,
        lineage=lineage,
        corpora=_corpora(reader, lineage, excluded),
        policy=_policy(directory, statement if verification.verified else {}, trust),
        memorization=_memorization(reader, lineage.trial_id, statement),
        verification=verification,
    )


def _corpora(reader: StoreReader, lineage: Lineage, excluded: list[str]) -> list[CorpusColumn]:
    """The experiment's training corpora (and any other corpus the ledger names), by id."""
    records = reader.corpora(lineage.experiment_id)  # the experiment of the lineage's trial
    reached = {counts.corpus_id for layer in lineage.layers for counts in layer.corpora}
    columns = {
        record.corpus_id: CorpusColumn(record.corpus_id, _credential(record), record.corpus_id in excluded)
        for record in records
        if record.role == "train" or record.corpus_id in reached
    }
    for corpus_id in reached - set(columns):
        columns[corpus_id] = CorpusColumn(corpus_id, dict.fromkeys(CREDENTIAL_FIELDS, "not recorded"), False)
    return [columns[corpus_id] for corpus_id in sorted(columns)]


def _credential(record: CorpusRecord) -> dict[str, str]:
    try:
        raw = json.loads(record.credential_json)
    except json.JSONDecodeError:
        raw = {}
    credential = raw if isinstance(raw, dict) else {}
    return {name: str(credential.get(name, "per row")) for name in CREDENTIAL_FIELDS}


def _policy(directory: Path, statement: dict[str, Any], trust: Path | None) -> PolicySummary:
    """The policy from the run spec beside the model files (as their signed manifest lists it,
    under the server's trust), else what the attestation names; who signed it as the
    (platform-signed) attestation states."""
    attested = _external(statement).get("policy", {})  # ({} unless the attestation verified)
    signer = str(attested.get("signer", "not attested")) if statement else "no verified attestation says"
    try:
        if trust is None:
            raise ConfigError("the server has no trust file to check the run spec's signature with")
        spec = signed_run_spec(directory, load_trust(trust))
    except GovrayError as error:
        return PolicySummary(
            name=str(attested.get("name", "unknown")),
            version=str(attested.get("version", "?")),
            digest=str(attested.get("sha256", "unknown")),
            rules=[],
            signer=signer,
            note=f"rules unavailable: {error}",
        )
    policy = spec.policy
    rules = [(rule.name, _matches(rule.match), _route(rule.route)) for rule in policy.rules]
    if policy.default is not None:
        rules.append(("default", "anything else", _route(policy.default)))
    return PolicySummary(policy.name, str(policy.version), spec.policy_digest or "unknown", rules, signer)


def _matches(match: dict[str, Any]) -> str:
    if not match:
        return "every credential"
    parts = []
    for field, wanted in match.items():
        values = wanted if isinstance(wanted, list) else [wanted]
        parts.append(f"{field} in {{{', '.join(str(v) for v in values)}}}")
    return " and ".join(parts)


def _route(route: Any) -> str:
    if route == "all":
        return "all layers"
    if getattr(route, "adapter", None):
        return f"only adapter {route.adapter}"
    parts = []
    if getattr(route, "params", ()):
        parts.append("parameters " + ", ".join(route.params))
    depth = getattr(route, "depth", None)
    if depth is not None:
        low = "bottom" if depth.min is None else str(depth.min)
        high = "top" if depth.max is None else str(depth.max)
        parts.append(f"layers {low}..{high}")
    return " or ".join(parts)


def _memorization(reader: StoreReader, trial_id: int, statement: dict[str, Any]) -> Memorization:
    report = _byproduct(statement, "memorization-report")
    rows = [
        MemorizationRow(
            corpus_id=corpus_id,
            score=float(verdict.get("score", 0.0)),
            flagged=bool(verdict.get("flagged", False)),
            measures={k: float(v) for k, v in verdict.get("normalized", {}).items()},
        )
        for corpus_id, verdict in sorted(report.get("corpora", {}).items())
        if isinstance(verdict, dict)
    ]
    action = str(report.get("thresholds", {}).get("action", "")) if report else ""
    metrics: dict[str, float] = {}
    for name in ("memorization_score", "memorization_flagged"):
        total = reader.metrics(trial_id, Window(limit=1), name).total
        if total:  # metrics come by step: the last one is the latest
            metrics[name] = reader.metrics(trial_id, Window(offset=total - 1, limit=1), name).items[0].value
    return Memorization(rows, action, metrics)


def _verify(envelope: AttestationRecord | None, directory: Path, trust: Path | None) -> Verification:
    """Verify the provenance envelope against the model files under the server's trust file (read
    each time: a key revoked a minute ago counts)."""
    if envelope is None:
        return Verification(False, "FAILED: no provenance attestation is stored for these model files")
    if trust is None:
        return Verification(False, "FAILED: the server has no trust file configured (GOVRAY_TRUST)")
    try:
        trusted = load_trust(trust)
    except SignatureError as error:
        return Verification(False, f"FAILED: the server's trust file is unusable: {error}")
    result = check_envelope(envelope.envelope_json, directory, trusted, name=f"attestation {envelope.id}")
    if not result.ok:
        return Verification(False, f"FAILED: {result.reason}")
    return Verification(True, f"verified, signed by {result.signer}")


def _external(statement: dict[str, Any]) -> dict[str, Any]:
    predicate = statement.get("predicate", {})
    build = predicate.get("buildDefinition", {}) if isinstance(predicate, dict) else {}
    found = build.get("externalParameters", {}) if isinstance(build, dict) else {}
    return found if isinstance(found, dict) else {}


def _byproduct(statement: dict[str, Any], name: str) -> dict[str, Any]:
    predicate = statement.get("predicate", {})
    details = predicate.get("runDetails", {}) if isinstance(predicate, dict) else {}
    for item in details.get("byproducts", []) if isinstance(details, dict) else []:
        if isinstance(item, dict) and item.get("name") == name:
            content = item.get("annotations", {}).get("content", {})
            return content if isinstance(content, dict) else {}
    return {}


__all__ = ["LineageSheet", "NotFoundError", "checkpoint_sheet", "index_entries", "version_sheet"]
