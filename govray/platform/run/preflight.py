"""What runs before any training: the signed policy, the routing table, and the ingest.

Each step records what a reviewer must be able to see later in the audit log: a run allowed
with an unsigned policy, a verified policy, a refused ingest, a completed ingest.

Example::

    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)   # SignatureError if unsigned
    result = ingest_experiment(config, checked, store)             # IngestError names the row
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from govray.config.experiment import ExperimentConfig
from govray.core.canonical import canonical_json, file_sha256, sha256_hex
from govray.core.errors import ConfigError, GovrayError, IngestError, SignatureError
from govray.core.keys import TrustConfig, load_trust
from govray.core.runtime import ensure_ray
from govray.core.settings import load_settings, operator_trust, settings_path
from govray.data.ingest import IngestResult, ingest
from govray.governance.policy import UNSIGNED_POLICY, VerifiedPolicy, load_verified_policy
from govray.governance.routing import RoutingTable
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.drift import FingerprintChange, changed_corpora
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment
from govray.train.trial import make_trial, resolve_trial_routes


def config_digest(config: ExperimentConfig) -> str:
    return sha256_hex(canonical_json(config.model_dump(mode="json")))


@dataclass(frozen=True)
class CheckedPolicy:
    """A verified policy, resolved against the trial's model, with the trust its run's checkpoints
    are verified against: read once, here, and everything after (the run's checkpoints, a start
    checkpoint, a replay's comparison) is checked against the same keys."""

    policy: VerifiedPolicy
    routing: RoutingTable
    # The platform keys whose checkpoints are accepted, and their revocations: the operator's
    # (``operator_trust``), never the experiment's trust file, which only checks the policy.
    trust: TrustConfig
    policy_trust_sha256: str  # sha256 of the trust file the policy was checked against ("": none)

    @property
    def policy_signer(self) -> str:
        """The policy envelope's signer keyid, or ``unsigned`` (allowed, and audited)."""
        signature = self.policy.signature
        return signature.keyid if signature is not None else UNSIGNED_POLICY


def check_policy(config: ExperimentConfig, store: TrackingStore, *, allow_unsigned: bool) -> CheckedPolicy:
    """Verify the policy's signature and resolve it against the trial's model (built on the meta
    device, with the default hyperparameters).

    Who vouches for the policy is the operator's choice (:func:`policy_trust_file`): with a trust
    file in the settings, the policy authorities it lists, and an unsigned policy only for an
    experiment its ``unsigned_policies`` names; on a development machine with none, the
    experiment's ``policy.trust``. ``allow_unsigned`` (or ``policy.allow_unsigned`` in the config)
    asks to run an unsigned policy; the audit log records each run it let through.
    """
    audit = AuditLog(store)
    ref = config.policy
    try:
        trust_path = policy_trust_file(config)
        unsigned_asked = allow_unsigned or ref.allow_unsigned
        verified = load_verified_policy(
            ref.file,
            ref.signature_path,
            load_trust(trust_path) if trust_path is not None else None,
            allow_unsigned=unsigned_asked and _operator_allows_unsigned(config),
        )
    except GovrayError as error:
        audit.append(AuditEventType.RUN_REFUSED, {"experiment": config.name, "reason": str(error)})
        raise
    if verified.signature is None:
        operator = load_settings().trust is not None
        audit.append(
            AuditEventType.POLICY_UNSIGNED_ALLOWED,
            {
                "experiment": config.name,
                "policy": verified.path,
                "policy_digest": verified.digest,
                # who let it through: the operator's settings, or nobody's (a development machine)
                "allowed_by": "unsigned_policies" if operator else "no operator trust",
            },
        )
    else:
        audit.append(
            AuditEventType.POLICY_VERIFIED,
            {
                "experiment": config.name,
                "policy": verified.policy.name,
                "version": verified.policy.version,
                "policy_digest": verified.digest,
                "keyid": verified.signature.keyid,
                "signed_at": verified.signature.signed_at.isoformat(),
            },
        )
    hparams = config.default_hparams()
    trial = make_trial(config.trial, hparams, config.training.with_hyperparameters(hparams))
    routing = resolve_trial_routes(verified.policy, trial)  # on the meta device: no weights allocated
    return CheckedPolicy(
        policy=verified,
        routing=routing,
        # (a policy check or an ingest needs no platform key: a run's launch says how to create one)
        trust=operator_trust(required=False),
        policy_trust_sha256=file_sha256(trust_path) if trust_path is not None else "",
    )


def policy_trust_file(config: ExperimentConfig) -> Path | None:
    """The trust file whose policy authorities may sign this experiment's policy: the operator's
    (the settings' ``trust``) wherever the settings name one — an experiment naming another in
    ``policy.trust`` is refused (ConfigError), the engineer does not choose who vouches for their
    policy; else, on a development machine, the experiment's ``policy.trust`` (None: none)."""
    operator = load_settings().trust
    named = config.policy.trust
    if operator is None:
        return named
    if named is not None and named.resolve() != operator.resolve():
        raise ConfigError(
            f"policy.trust ({named}) in experiment '{config.name}': this machine's settings "
            f"({settings_path()}) name the operator's trust file ({operator}), and only the policy "
            "authorities it lists vouch for a policy here; remove policy.trust from the experiment file"
        )
    return operator


def _operator_allows_unsigned(config: ExperimentConfig) -> bool:
    """Whether an unsigned policy may run for this experiment (when asked): always on a
    development machine (no trust file in the settings); else only for an experiment the
    settings' ``unsigned_policies`` names — SignatureError otherwise."""
    settings = load_settings()
    if settings.trust is None or config.name in settings.unsigned_policies:
        return True
    raise SignatureError(
        f"experiment '{config.name}' asks to run an unsigned policy ({config.policy.file}); the operator's "
        f"settings ({settings_path()}) allow that only for the experiments unsigned_policies lists"
    )


def existing_experiment(config: ExperimentConfig, store: TrackingStore) -> Experiment | None:
    """The newest experiment of this name with the same config, if any."""
    digest = config_digest(config)
    for experiment in reversed(store.list_experiments()):
        if experiment.name == config.name and experiment.config_digest == digest:
            return experiment
    return None


def _experiment_for(
    config: ExperimentConfig, store: TrackingStore, policy: VerifiedPolicy, fork_of: int | None
) -> Experiment:
    """The newest experiment of this name with the same config, else (or when forking) a new one."""
    digest = config_digest(config)
    if fork_of is None and (existing := existing_experiment(config, store)) is not None:
        return existing
    experiment = store.create_experiment(
        name=config.name,
        config_json=config.model_dump_json(),
        config_digest=digest,
        storage_path=config.storage_path,
        description=config.description,
        policy_digest=policy.digest,
    )
    assert experiment.id is not None
    AuditLog(store).append(
        AuditEventType.EXPERIMENT_CREATED,
        {"name": config.name, "config_digest": digest},
        experiment_id=experiment.id,
    )
    if fork_of is not None:
        store.set_parent(experiment.id, fork_of)
        AuditLog(store).append(
            AuditEventType.EXPERIMENT_FORKED,
            {"parent": fork_of, "child": experiment.id, "config_digest": digest},
            experiment_id=experiment.id,
        )
    return experiment


def ingest_experiment(
    config: ExperimentConfig,
    checked: CheckedPolicy,
    store: TrackingStore,
    *,
    force: bool = False,
    strict: bool = False,
    warn: Callable[[str], None] | None = None,
    fork_of: int | None = None,
    check: Callable[[IngestResult], None] | None = None,
) -> tuple[Experiment, IngestResult]:
    """Ingest the experiment's corpora and record them (and the outcome) in the tracking store.

    A corpus whose fingerprint differs from the previous run of this experiment is reported
    through ``warn`` and the audit log; with ``strict`` the ingest is refused instead.
    ``fork_of`` makes a new experiment whose lineage parent is that one, even for the same config.
    ``check`` refuses what the caller cannot run on these shards (raising a ``GovrayError``).

    A refusal (an ingest error, a changed corpus under ``strict``, ``check``) happens before the
    experiment is created: it leaves its audit events (``ingest.refused`` or ``run.refused``,
    naming the experiment) and nothing else in the tracking store.
    """
    audit = AuditLog(store)
    existing = existing_experiment(config, store) if fork_of is None else None
    refused_in = existing.id if existing is not None else None
    refusal = {"experiment": config.name, "config_digest": config_digest(config)}
    ensure_ray()
    try:
        result = ingest(config, checked.policy, force=force)
    except GovrayError as error:
        audit.append(
            AuditEventType.INGEST_REFUSED, {**refusal, "reason": str(error)}, experiment_id=refused_in
        )
        raise
    fingerprints = {corpus.corpus_id: corpus.fingerprint for corpus in result.manifest.corpora}
    changes = changed_corpora(store, config.name, fingerprints)
    if strict and changes:
        for change in changes:
            audit.append(
                AuditEventType.DATA_CHANGED,
                {"experiment": config.name, **_change(change), "strict": strict},
                experiment_id=refused_in,
            )
        reason = f"{'; '.join(_changed(config.name, change) for change in changes)}; refused (--strict)"
        audit.append(AuditEventType.INGEST_REFUSED, {**refusal, "reason": reason}, experiment_id=refused_in)
        raise IngestError(reason)
    if check is not None:
        try:
            check(result)
        except GovrayError as error:
            audit.append(
                AuditEventType.RUN_REFUSED, {**refusal, "reason": str(error)}, experiment_id=refused_in
            )
            raise
    experiment = _experiment_for(config, store, checked.policy, fork_of)
    assert experiment.id is not None
    for change in changes:
        audit.append(
            AuditEventType.DATA_CHANGED, {**_change(change), "strict": strict}, experiment_id=experiment.id
        )
        if warn is not None:
            warn(_changed(config.name, change))
    _record_ingest(store, audit, experiment.id, result)
    return experiment, result


def _changed(experiment: str, change: FingerprintChange) -> str:
    return (
        f"corpus '{change.corpus_id}' changed since the previous run of '{experiment}' "
        f"(fingerprint {change.before[:16]}… → {change.after[:16]}…)"
    )


def _record_ingest(store: TrackingStore, audit: AuditLog, experiment_id: int, result: IngestResult) -> None:
    """The experiment's corpora (credential, counts, routes), its ``ingested`` state, and the
    ``ingest.completed`` event with every corpus's fingerprint."""
    store.record_corpora(
        experiment_id,
        [
            {
                "corpus_id": corpus.corpus_id,
                "role": corpus.role,
                "fingerprint": corpus.fingerprint,
                "rows": corpus.rows,
                "train_rows": corpus.train_rows,
                "holdout_rows": corpus.holdout_rows,
                "credential_json": canonical_json(corpus.credential).decode(),
                "route_counts_json": canonical_json(corpus.route_counts).decode(),
            }
            for corpus in result.manifest.corpora
        ],
    )
    store.set_experiment_state(experiment_id, "ingested")
    audit.append(
        AuditEventType.INGEST_COMPLETED,
        {
            "shards": result.manifest.key,
            "reused": result.reused,
            "fingerprints": {c.corpus_id: c.fingerprint for c in result.manifest.corpora},
        },
        experiment_id=experiment_id,
    )


def _change(change: FingerprintChange) -> dict[str, str]:
    return {"corpus": change.corpus_id, "before": change.before, "after": change.after}
