"""The tracking store: one database (a ``sqlite:///`` file or PostgreSQL) behind small verbs.

>>> store = TrackingStore.open("sqlite:///runs/tracking.db")     # doctest: +SKIP
>>> exp = store.create_experiment("demo", "{}", "ab12...", "/runs/demo")  # doctest: +SKIP
>>> store.set_experiment_state(exp.id, ExperimentState.ACTIVE)  # doctest: +SKIP

Only the driver and the Ray Train controller (whose callback receives the workers' reports) write
here, never the workers: each row has one writer.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import delete
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from govray.core.errors import TrackingError
from govray.core.identifiers import MAX_ID, ExperimentName, check
from govray.tracking.database import (  # the database half, re-exported for this module's callers
    SQLITE_BUSY_TIMEOUT_MS,
    alembic_config,
    create_tracking_engine,
    current_revision,
    masked,
    upgrade,
)
from govray.tracking.table_rows import (
    add_decisions,
    advance,
    corpora_of,
    corpus_record,
    decisions_of,
    member,
    metric_rows,
    require,
)
from govray.tracking.tables import (
    TERMINAL_TRIAL_STATES,
    ControlRequest,
    CorpusRecord,
    DecisionRecord,
    Experiment,
    ExperimentState,
    Metric,
    MetricKind,
    TrialKind,
    TrialRecord,
    TrialState,
    utcnow,
)

__all__ = [
    "SQLITE_BUSY_TIMEOUT_MS",
    "TrackingStore",
    "alembic_config",
    "create_tracking_engine",
    "current_revision",
    "masked",
    "upgrade",
]


class TrackingStore:
    """Experiments, trials, corpora and metrics in one database.

    ``TrackingStore(url)`` connects; ``TrackingStore.open(url)`` also migrates to the newest
    schema first, which is what callers normally want.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = create_tracking_engine(url)

    @classmethod
    def open(cls, url: str) -> TrackingStore:
        """Connect to ``url``, migrate it to head, and return the store."""
        store = cls(url)
        upgrade(store.engine)
        return store

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()

    def __repr__(self) -> str:
        return f"TrackingStore({masked(self.url)!r})"

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """A unit of work: commits when the block ends normally, rolls back on an exception.

        Objects stay readable after the block (``expire_on_commit=False``).
        """
        with Session(self.engine, expire_on_commit=False) as session:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise

    # -- experiments -------------------------------------------------------------------------

    def create_experiment(
        self,
        name: str,
        config_json: str,
        config_digest: str,
        storage_path: str,
        description: str = "",
        policy_digest: str | None = None,
    ) -> Experiment:
        """Record a new experiment in state ``created``."""
        experiment = Experiment(
            name=name,
            description=description,
            config_json=config_json,
            config_digest=config_digest,
            policy_digest=policy_digest,
            storage_path=storage_path,
        )
        with self.session() as session:
            session.add(experiment)
        return experiment

    def get_experiment(self, id_or_name: int | str) -> Experiment:
        """The experiment with this id, or the newest one with this name.

        A string of ASCII digits that names no experiment is read as an id (what a CLI passes); a
        string that is neither a name nor an id is an ``IdentifierError``.
        """
        if isinstance(id_or_name, str):
            check(ExperimentName, id_or_name, "experiment (an id or a name)")
        with self.session() as session:
            if isinstance(id_or_name, int):
                found = session.get(Experiment, id_or_name) if 1 <= id_or_name <= MAX_ID else None
            else:
                newest_first = col(Experiment.id).desc()
                query = select(Experiment).where(Experiment.name == id_or_name)
                found = session.exec(query.order_by(newest_first)).first()
                if found is None and id_or_name.isdigit() and 1 <= int(id_or_name) <= MAX_ID:
                    found = session.get(Experiment, int(id_or_name))
        if found is None:
            raise TrackingError(f"no experiment {id_or_name!r} in tracking store {masked(self.url)}")
        return found

    def list_experiments(self) -> list[Experiment]:
        """All experiments, oldest first."""
        with self.session() as session:
            return list(session.exec(select(Experiment).order_by(col(Experiment.id))))

    def set_experiment_state(self, experiment_id: int, state: ExperimentState | str) -> Experiment:
        """Move an experiment to ``state`` (one of ExperimentState) and stamp ``updated_at``."""
        new_state = member(ExperimentState, state)
        with self.session() as session:
            experiment = require(session, Experiment, experiment_id)
            experiment.state = new_state.value
            experiment.updated_at = utcnow()
            session.add(experiment)
        return experiment

    def request(self, experiment_id: int, request: ControlRequest | str | None) -> Experiment:
        """Ask the experiment's driver to pause or kill it at the next step boundary (None clears)."""
        value = None if request is None else member(ControlRequest, request).value
        with self.session() as session:
            experiment = require(session, Experiment, experiment_id)
            experiment.requested = value
            experiment.updated_at = utcnow()
            session.add(experiment)
        return experiment

    def set_gc_policy(self, experiment_id: int, policy_json: str | None) -> Experiment:
        """Replace the experiment's checkpoint GC policy (None: back to its config's)."""
        with self.session() as session:
            experiment = require(session, Experiment, experiment_id)
            experiment.gc_policy_json = policy_json
            experiment.updated_at = utcnow()
            session.add(experiment)
        return experiment

    def set_parent(self, experiment_id: int, parent_id: int) -> Experiment:
        """Record that ``experiment_id`` was forked from ``parent_id``."""
        with self.session() as session:
            require(session, Experiment, parent_id)
            experiment = require(session, Experiment, experiment_id)
            experiment.parent_id = parent_id
            session.add(experiment)
        return experiment

    # -- corpora -----------------------------------------------------------------------------

    def record_corpora(self, experiment_id: int, records: Iterable[Mapping[str, Any]]) -> list[CorpusRecord]:
        """Store the ingested corpora of an experiment, replacing any from an earlier ingest.

        Each record holds CorpusRecord's fields (corpus_id, role, fingerprint, rows, train_rows,
        holdout_rows, credential_json, route_counts_json); unknown or missing fields and a
        corpus id given twice are refused, leaving the earlier rows in place.
        """
        rows = [corpus_record(experiment_id, record) for record in records]
        corpus_ids = [row.corpus_id for row in rows]
        if twice := sorted({cid for cid in corpus_ids if corpus_ids.count(cid) > 1}):
            raise TrackingError(f"corpus ids given more than once: {', '.join(twice)}")
        with self.session() as session:
            require(session, Experiment, experiment_id)
            owned = col(CorpusRecord.experiment_id) == experiment_id
            session.execute(delete(CorpusRecord).where(owned))
            session.add_all(rows)
        return rows

    def list_corpora(self, experiment_id: int) -> list[CorpusRecord]:
        """The corpora recorded for an experiment, by corpus id."""
        with self.session() as session:
            return corpora_of(session, experiment_id)

    def corpus_ingests(self, corpus_id: str) -> list[CorpusRecord]:
        """Every experiment's record of corpus ``corpus_id``, oldest experiment first."""
        with self.session() as session:
            query = select(CorpusRecord).where(CorpusRecord.corpus_id == corpus_id)
            return list(session.exec(query.order_by(col(CorpusRecord.experiment_id))))

    def corpus_ids(self) -> list[str]:
        """The ids of every corpus any experiment ingested, sorted."""
        with self.session() as session:
            return sorted(set(session.exec(select(CorpusRecord.corpus_id))))

    # -- trials and metrics ------------------------------------------------------------------

    def create_trial(
        self,
        experiment_id: int,
        hparams_json: str,
        seed: int,
        ray_run_name: str | None = None,
        cloned_from: int | None = None,
        replay_of: int | None = None,
    ) -> TrialRecord:
        """Record a new trial of an experiment in state ``pending``: an original, or a replay of
        trial ``replay_of``."""
        trial = TrialRecord(
            experiment_id=experiment_id,
            hparams_json=hparams_json,
            seed=seed,
            ray_run_name=ray_run_name,
            cloned_from=cloned_from,
            kind=(TrialKind.ORIGINAL if replay_of is None else TrialKind.REPLAY).value,
            replay_of=replay_of,
        )
        with self.session() as session:
            require(session, Experiment, experiment_id)
            if replay_of is not None:
                require(session, TrialRecord, replay_of)
            session.add(trial)
        return trial

    def get_trial(self, trial_id: int) -> TrialRecord:
        """The trial with this id."""
        with self.session() as session:
            return require(session, TrialRecord, trial_id)

    def list_trials(self, experiment_id: int) -> list[TrialRecord]:
        """The trials of an experiment, oldest first."""
        with self.session() as session:
            query = select(TrialRecord).where(TrialRecord.experiment_id == experiment_id)
            return list(session.exec(query.order_by(col(TrialRecord.id))))

    def set_trial_state(
        self, trial_id: int, state: TrialState | str, ray_run_name: str | None = None
    ) -> TrialRecord:
        """Move a trial to ``state``; a terminal state stamps ``ended_at``."""
        new_state = member(TrialState, state)
        with self.session() as session:
            trial = require(session, TrialRecord, trial_id)
            trial.state = new_state.value
            if ray_run_name is not None:
                trial.ray_run_name = ray_run_name
            if new_state in TERMINAL_TRIAL_STATES:
                trial.ended_at = utcnow()
            session.add(trial)
        return trial

    def set_trial_reproducibility(self, trial_id: int, record_json: str) -> TrialRecord:
        """Keep the trial's reproducibility record (environment, code, corpus snapshots)."""
        with self.session() as session:
            trial = require(session, TrialRecord, trial_id)
            trial.reproducibility_json = record_json
            session.add(trial)
        return trial

    def set_cloned_from(self, trial_id: int, donor_id: int) -> TrialRecord:
        """Record that a trial continued another's state (a PBT exploit): its lineage parent."""
        with self.session() as session:
            require(session, TrialRecord, donor_id)
            trial = require(session, TrialRecord, trial_id)
            trial.cloned_from = donor_id
            session.add(trial)
        return trial

    def record_report(
        self,
        trial_id: int,
        step: int,
        scalars: Mapping[MetricKind | str, Mapping[str, float]],
        stop_reason: str | None = None,
        cloned_from: int | None = None,
    ) -> TrialRecord:
        """One report in one transaction: its scalars (by kind) and the trial's progress. A driver
        that dies while recording a report leaves neither, so the report recorded again (from its
        checkpoint's ``report.json``) records both."""
        rows = [row for kind, values in scalars.items() for row in metric_rows(trial_id, step, kind, values)]
        try:
            with self.session() as session:
                session.add_all(rows)
                return advance(session, trial_id, step, stop_reason, cloned_from)
        except IntegrityError as exc:
            raise TrackingError(f"cannot log metrics for trial {trial_id}: {exc.orig}") from exc

    def clear_stop(self, trial_id: int) -> None:
        """A trial that runs again (a resume) is no longer stopped."""
        with self.session() as session:
            trial = require(session, TrialRecord, trial_id)
            trial.stop_reason = None
            session.add(trial)

    def set_trial_world_history(self, trial_id: int, history: Sequence[tuple[int, int]]) -> TrialRecord:
        """Record the world sizes the trial trained on (``[(from_step, workers), ...]``)."""
        with self.session() as session:
            trial = require(session, TrialRecord, trial_id)
            trial.world_history_json = json.dumps([[step, workers] for step, workers in history])
            session.add(trial)
        return trial

    def set_trial_source(self, trial_id: int, source_json: str) -> TrialRecord:
        """Record the checkpoint a trial started from (its lineage parent)."""
        with self.session() as session:
            trial = require(session, TrialRecord, trial_id)
            trial.source_checkpoint_json = source_json
            session.add(trial)
        return trial

    def record_decisions(
        self,
        trial_id: int,
        decisions: Iterable[Mapping[str, Any]],
        replayed: bool,
        *,
        superseding: bool = False,
    ) -> int:
        """Store decisions (``seq``, ``step``, ``kind`` and the rest as payload) not yet stored.

        A restarted worker group re-reports decisions it made before its checkpoint: rows already
        recorded under the same ``seq`` are kept, and a different decision there is refused. A PBT
        clone reports the decisions its donor's state carries (``superseding``): the trial's rows
        become exactly those, its own before the exploit gone with the state they were of.
        Returns how many rows were added.
        """
        with self.session() as session:
            return add_decisions(session, trial_id, decisions, replayed, superseding)

    def decisions(self, trial_id: int) -> list[DecisionRecord]:
        """A trial's recorded decisions, in order."""
        with self.session() as session:
            return decisions_of(session, trial_id)

    def log_metrics(
        self, trial_id: int, step: int, kind: MetricKind | str, values: Mapping[str, float]
    ) -> None:
        """Record the scalars a trial reported at ``step``.

        NaN is refused (SQLite would silently store it as NULL); the caller decides what a NaN
        loss means. Infinities are stored as they are.
        """
        rows = metric_rows(trial_id, step, kind, values)
        try:
            with self.session() as session:
                session.add_all(rows)
        except IntegrityError as exc:
            raise TrackingError(f"cannot log metrics for trial {trial_id}: {exc.orig}") from exc

    def reported_steps(self, trial_id: int) -> set[int]:
        """The steps at which a trial's reports were recorded (whichever scalars they carried)."""
        with self.session() as session:
            return set(session.exec(select(Metric.step).where(Metric.trial_id == trial_id).distinct()))

    def metrics(
        self, trial_id: int, name: str | None = None, *, since_step: int = 0, after_id: int = 0
    ) -> list[Metric]:
        """A trial's metrics (only ``name`` when given; only steps ≥ ``since_step``; only rows
        recorded after row ``after_id``), ordered by name then step."""
        query = select(Metric).where(Metric.trial_id == trial_id, col(Metric.id) > after_id)
        if name is not None:
            query = query.where(Metric.name == name)
        if since_step:
            query = query.where(Metric.step >= since_step)
        order = (col(Metric.name), col(Metric.step), col(Metric.id))
        with self.session() as session:
            return list(session.exec(query.order_by(*order)))
