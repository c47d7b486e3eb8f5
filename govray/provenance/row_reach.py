"""Row-level lineage: which trials, steps, checkpoints and parameter tensors one row reached.

The answer to an erasure request ("did row 17 of corpus C train this model, and which part?")
comes from the recorded schedule, never from a guess: for every trial of an experiment that
ingested corpus C,

1. the row's place in that experiment's shards: its route and its position in
   ``shards/train/ROUTE`` (rows are ordered by corpus, then row number), or the holdout split,
   which no training step reads;
2. per epoch, the row's position in the route's permutation, hence its batch, hence the one global
   step (and rank) whose slot held it (``govray.data.schedule``'s own epoch plan, not a scan of every
   step); exclusions and gates (``withheld_corpora``) drop it from a slot, and a step a rollback
   discarded (``reverted``) is listed apart, since its update left the weights;
3. the checkpoints saved after a step that reached it (before any rollback undid that step): their
   weights carry its influence;
4. the tensors its route may update per the run's routing table: the adapter's LoRA tensors
   (``adapter/NAME/...``) for an adapter route, the allowed base parameters otherwise.

Example::

    reach = row_reach(store, "digits-writers", 17)
    for trial in reach.trials:
        trial.steps, trial.checkpoints, trial.tensors
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from govray.core.errors import GovrayError, IngestError
from govray.core.identifiers import CorpusId, check
from govray.data.packed import PackedStore
from govray.data.schedule import ScheduleSpec
from govray.data.shards import ShardSet
from govray.data.slots import row_slots
from govray.governance.routing import RoutingTable, layer_label
from govray.provenance.locations import recorded_run_spec
from govray.tracking.lineage import as_of, checkpoints
from govray.tracking.registry import versions_of_checkpoints
from govray.tracking.store import TrackingStore, masked
from govray.tracking.tables import LIVE_TRIAL_STATES, CheckpointRecord, CorpusRecord, Experiment, TrialRecord
from govray.train.checkpoints.manifest import STATE_FILE, CheckpointError, CheckpointState, recorded_state
from govray.train.runspec import RunSpec, read_run_spec

MAX_LISTED_STEPS = 1000  # steps listed per trial; ``step_count`` always gives them all


class LineageError(GovrayError):
    """A row lookup cannot be answered: unknown corpus, a row out of range, inconsistent records."""

    exit_code = 18


class RowPlacement(BaseModel):
    """Where an ingest put the row: a training route and its position there, or the holdout."""

    model_config = ConfigDict(frozen=True)

    shards: str  # the ingest's key
    split: Literal["train", "holdout"]
    route: str | None = None
    position: int | None = None  # route-local row index: what the schedule's slots list
    # Under data.packing: the positions of the windows holding its tokens (what the slots list).
    windows: list[int] | None = None


class ReachedCheckpoint(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: int
    step: int
    path: str
    state: str  # active, or deleted by GC (the record stays)


class ReachedModel(BaseModel):
    """A registered model version whose weights descend from a checkpoint the row reached."""

    model_config = ConfigDict(frozen=True)

    model: str
    version: int
    checkpoint_id: int
    carries_row: bool  # False: the version removed the adapter that held the row's influence
    removed_adapters: list[str]


class TrialReach(BaseModel):
    """What the row reached in one trial."""

    model_config = ConfigDict(frozen=True)

    experiment_id: int
    experiment: str
    trial_id: int
    run_name: str | None
    corpus_fingerprint: str  # of the corpus as this experiment ingested it
    placement: RowPlacement | None  # None: the trial's shards are not readable (see note)
    trial_state: str
    running: bool  # the trial still trains: later checkpoints may add steps
    as_of: str  # "as of step N (running)": the checkpoint the answer is read from
    trained_steps: int  # global steps the trial's last checkpoint covers
    step_count: int  # global steps whose update the row's gradient joined, still in the weights
    steps: list[int]  # the first MAX_LISTED_STEPS of them
    reverted_steps: list[int]  # trained with the row, then discarded by a rollback
    checkpoints: list[ReachedCheckpoint]  # saved after such a step: they carry its influence
    models: list[ReachedModel] = []  # registered versions of those checkpoints
    tensors: list[str]  # the tensors its route updated (empty when it reached no step)
    layers: list[str]  # their layers; ``adapter:NAME`` for adapter tensors
    note: str = ""  # why it reached nothing, when it did not

    @property
    def reached(self) -> bool:
        return self.step_count > 0 or bool(self.reverted_steps)


class RowReach(BaseModel):
    """Every trial in the tracking store that row ``row`` of ``corpus_id`` could have reached."""

    model_config = ConfigDict(frozen=True)

    corpus_id: str
    row: int
    trials: list[TrialReach]

    @property
    def reached(self) -> bool:
        return any(trial.reached for trial in self.trials)


def row_reach(store: TrackingStore, corpus_id: str, row: int) -> RowReach:
    """Which trials, steps, checkpoints and parameter tensors row ``row`` (0-based, as ingested:
    files in sorted order) of corpus ``corpus_id`` reached, from the recorded schedules.

    Raises ``LineageError`` for a malformed corpus id, a corpus no experiment ingested or a row
    outside every ingest."""
    corpus_id = check(CorpusId, corpus_id, "corpus id", LineageError)
    records = _corpus_records(store, corpus_id)
    largest = max(record.rows for record in records)
    if not 0 <= row < largest:
        raise LineageError(
            f"corpus '{corpus_id}' has {largest} rows (0..{largest - 1}); there is no row {row}"
        )
    places = _Places(corpus_id, row)
    trials = []
    for record in records:
        experiment = store.get_experiment(record.experiment_id)
        for trial in store.list_trials(record.experiment_id):
            if row >= record.rows:
                continue  # this ingest of the corpus was smaller
            trials.append(_trial_reach(store, experiment, trial, record, places))
    return RowReach(corpus_id=corpus_id, row=row, trials=trials)


def row_steps(spec: ScheduleSpec, route: str, position: int, steps: int) -> tuple[list[int], list[int]]:
    """The global steps below ``steps`` whose slot held route-local row ``position`` of ``route``:
    ``(reached, reverted)``, where a reverted step was trained and then discarded by a rollback.

    At most one step per epoch (``govray.data.slots.row_slots``). Steps at which its corpus was excluded or
    gated are in neither list."""
    routes = [item.route for item in spec.routes]
    if route not in routes:
        raise LineageError(f"the schedule has no route '{route}' (routes: {', '.join(routes)})")
    reached: list[int] = []
    reverted: list[int] = []
    for global_step, _ in row_slots(spec, route, position, math.ceil(steps / spec.steps_per_epoch)):
        if global_step < steps:
            (reverted if spec.reverted(global_step) else reached).append(global_step)
    return reached, reverted


def in_weights(spec: ScheduleSpec, global_step: int, checkpoint_step: int) -> bool:
    """Whether the update of ``global_step`` is in the weights of the checkpoint saved after
    ``checkpoint_step`` steps: taken before it, and not undone by a rollback taken by then."""
    return global_step < checkpoint_step and not any(
        event.kind == "rollback"
        and event.to_step is not None
        and event.to_step <= global_step < event.step <= checkpoint_step
        for event in spec.events
    )


def _corpus_records(store: TrackingStore, corpus_id: str) -> list[CorpusRecord]:
    records = store.corpus_ingests(corpus_id)
    if not records:
        raise LineageError(
            f"no experiment in tracking store {masked(store.url)} ingested corpus '{corpus_id}' "
            f"(corpora: {', '.join(store.corpus_ids()) or 'none'})"
        )
    return records


@dataclass
class _Places:
    """The row's placement per ingest (trials of one experiment share their shards)."""

    corpus_id: str
    row: int
    found: dict[str, RowPlacement] = field(default_factory=dict)

    def of(self, shard_root: Path) -> RowPlacement:
        key = str(shard_root.resolve())
        if key not in self.found:
            self.found[key] = self._locate(ShardSet.open(shard_root))
        return self.found[key]

    def _locate(self, shards: ShardSet) -> RowPlacement:
        key = shards.manifest.key
        try:
            found = shards.locate(self.corpus_id, self.row)  # the shards' row index: one row group read
        except IngestError as error:
            raise LineageError(str(error)) from None
        if found.split == "holdout":
            return RowPlacement(shards=key, split="holdout")
        return RowPlacement(shards=key, split="train", route=found.route, position=found.position)


def _trial_reach(
    store: TrackingStore, experiment: Experiment, trial: TrialRecord, record: CorpusRecord, places: _Places
) -> TrialReach:
    assert trial.id is not None and experiment.id is not None
    recorded = checkpoints(store, trial.id)
    base: dict[str, Any] = {
        "experiment_id": experiment.id,
        "experiment": experiment.name,
        "trial_id": trial.id,
        "run_name": trial.ray_run_name,
        "corpus_fingerprint": record.fingerprint,
        "trial_state": trial.state,
        "running": trial.state in LIVE_TRIAL_STATES,
    }
    nothing: dict[str, Any] = {
        "as_of": as_of(0, trial.state),
        "trained_steps": 0,
        "step_count": 0,
        "steps": [],
        "reverted_steps": [],
        "checkpoints": [],
    }
    latest = _latest(recorded)
    spec = _run_spec(experiment, trial, latest)
    if spec is None:
        note = f"no run spec: no checkpoint holds one, nor {experiment.storage_path}/runs"
        return TrialReach(**base, placement=None, **nothing, tensors=[], layers=[], note=note)
    placement = places.of(Path(spec.shard_root))
    state = latest[1] if latest else None
    if placement.split == "holdout" or state is None:
        note = (
            "in the holdout split: no training step reads it"
            if placement.split == "holdout"
            else "no checkpoint on storage records what it trained"
        )
        return TrialReach(**base, placement=placement, **nothing, tensors=[], layers=[], note=note)
    route, position = placement.route, placement.position
    assert route is not None and position is not None
    positions = [position]
    if spec.packed_root:  # the schedule ordered windows: the row's tokens lie in one or more
        positions = _windows(spec, places)
        placement = placement.model_copy(update={"windows": positions})
    schedule = ScheduleSpec.from_json(state.schedule)
    reached: list[int] = []
    reverted: list[int] = []
    for position in positions:
        if schedule.route(route).corpus_of(position) != places.corpus_id:
            raise LineageError(
                f"trial {trial.id}: its schedule puts another corpus at position {position} of route "
                f"'{route}' than its shards {placement.shards} do"
            )
        steps, undone = row_steps(schedule, route, position, state.step)
        reached, reverted = sorted(reached + steps), sorted(reverted + undone)
    touched = sorted(reached + reverted)
    kept = [
        ReachedCheckpoint(id=c.id or 0, step=c.step, path=c.path, state=c.state)
        for c in recorded
        if any(in_weights(schedule, step, c.step) for step in touched)
    ]
    routing = spec.routing
    tensors, layers = route_tensors(routing, route) if touched else ((), ())
    adapter = routing.adapter_names.get(route)
    return TrialReach(
        **base,
        placement=placement,
        as_of=as_of(state.step, trial.state),
        trained_steps=state.step,
        step_count=len(reached),
        steps=reached[:MAX_LISTED_STEPS],
        reverted_steps=reverted,
        checkpoints=kept,
        models=_models(store, [c.id for c in kept], adapter),
        tensors=list(tensors),
        layers=list(layers),
        note="" if touched else _why_not(schedule, places.corpus_id, state.step),
    )


def _windows(spec: RunSpec, places: _Places) -> list[int]:
    """The positions of the packed windows that hold the row's tokens (``PackedStore.locate``)."""
    try:
        return [
            position
            for _, position in PackedStore.open(Path(spec.packed_root)).locate(places.corpus_id, places.row)
        ]
    except IngestError as error:
        raise LineageError(str(error)) from None


def _models(store: TrackingStore, checkpoint_ids: list[int], adapter: str | None) -> list[ReachedModel]:
    """The registered versions of these checkpoints; one that removed ``adapter`` (the row's route's)
    no longer carries the row."""
    if not checkpoint_ids:
        return []
    found = []
    for version in versions_of_checkpoints(store, checkpoint_ids):
        removed = json.loads(version.removed_adapters_json)
        found.append(
            ReachedModel(
                model=version.model_name,
                version=version.version,
                checkpoint_id=version.checkpoint_id,
                carries_row=adapter is None or adapter not in removed,
                removed_adapters=removed,
            )
        )
    return found


def _run_spec(
    experiment: Experiment, trial: TrialRecord, latest: tuple[Path, CheckpointState, str] | None
) -> RunSpec | None:
    """The run's spec: the one its latest checkpoint holds (checked against the manifest the store
    recorded), else (no checkpoint yet) ``STORAGE/runs/RUN.json``."""
    if latest is not None:
        checkpoint, _, manifest_digest = latest
        return recorded_run_spec(checkpoint, manifest_digest)
    path = Path(experiment.storage_path) / "runs" / f"{trial.ray_run_name}.json"
    if trial.ray_run_name is None or not path.is_file():
        return None
    try:
        return read_run_spec(path)
    except CheckpointError as error:
        raise LineageError(f"trial {trial.id}: its run spec {path} is unreadable: {error}") from None


def _latest(recorded: list[CheckpointRecord]) -> tuple[Path, CheckpointState, str] | None:
    """The trial's latest checkpoint still on storage, its state (its schedule has every event),
    checked against the manifest the store recorded (a changed one raises ``CheckpointError``),
    and that manifest's digest."""
    for record in reversed(recorded):
        path = Path(record.path)
        if (path / STATE_FILE).is_file():
            return path, recorded_state(path, record.manifest_digest), record.manifest_digest
    return None


def route_tensors(routing: RoutingTable, route: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The tensors ``route`` updates and their layers (``adapter:NAME`` for an adapter route)."""
    tensors = routing.updated_tensors(route)
    if route in routing.adapter_names:
        return tensors, (layer_label(None, routing.adapter_names[route]),)
    indexes = sorted({i for i in map(routing.layer_of_tensor, tensors) if i is not None})
    return tensors, tuple(routing.layers[i] for i in indexes)


def _why_not(schedule: ScheduleSpec, corpus_id: str, trained: int) -> str:
    if corpus_id in schedule.excluded_corpora:
        return "its corpus was excluded from this trial"
    gates = [event.step for event in schedule.events if event.kind == "gate" and event.corpus_id == corpus_id]
    if gates:
        return f"its corpus was gated at step {min(gates)}, before the row's turn came"
    return f"its turn in the schedule comes after the {trained} steps this trial trained"
