"""A tracking store the size of a busy platform's, for ``lineage_load``: one real governed run plus
bulk-inserted synthetic experiments, through the real schema (``TrackingStore.open`` migrates it).

The real part is the digits example, trained for a few steps (one worker) and registered as
``digits`` v1: its corpora, ledger, checkpoints, signed attestations, run spec and shards are all
real, so a row lookup (``/api/corpora/C/rows/R``) recomputes that row's steps from the recorded
schedule, and its lineage names real layers.

The synthetic part has the shape of a hyperparameter-search platform: ``experiments`` experiments
of ``trials`` trials, each with ``checkpoints`` checkpoints; each experiment ingests 10 of a pool
of 60 corpora (5 routed to every base layer, 3 to the upper half, 2 to an adapter); the model has
48 layers of 10 tensors plus 20 adapter tensors. Each trial's ledger (3,160 rows) is stored once,
with no checkpoint id, as the runner stores it, and each experiment registers its first trial's
last checkpoint as a version of one of four models. Synthetic checkpoints have no files and no
attestation, so their layers are named by index (``layer N``) and they take no row lookups.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import Connection, func, insert, select

from govray.tracking.store import TrackingStore
from govray.tracking.tables import (
    CheckpointRecord,
    CorpusRecord,
    Experiment,
    LedgerRow,
    Metric,
    ModelVersion,
    RegisteredModel,
    TrialRecord,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "jobs" / "examples" / "digits"
LAYERS, TENSORS_PER_LAYER, ADAPTER_TENSORS = 48, 10, 20
CORPUS_POOL, CORPORA_PER_EXPERIMENT = 60, 10
ROUTES = ["all"] * 5 + ["upper"] * 3 + ["adapter"] * 2  # per experiment, in corpus order
MODELS = ["encoder", "ranker", "summarizer", "classifier"]
BATCH = 50_000  # ledger rows per executemany


@dataclass
class Workload:
    """The questions a load test can ask this store (URL paths of things that exist)."""

    lineage: list[str] = field(default_factory=list)  # model versions and checkpoints, some by layer
    influence: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)  # row lookups: the real run's corpora only
    ledger_rows: int = 0

    def extend(self, other: Workload) -> None:
        self.lineage += other.lineage
        self.influence += other.influence
        self.rows += other.rows
        self.ledger_rows += other.ledger_rows


def _lineage_paths(versions: list[tuple[str, int]], checkpoints: list[int], layers: list[str]) -> list[str]:
    paths = [f"/api/models/{name}/versions/{number}/lineage" for name, number in versions]
    paths += [f"/api/checkpoints/{checkpoint}/lineage" for checkpoint in checkpoints]
    return paths + [f"{path}?layer={layer}" for path in paths[: len(versions)] for layer in layers]


def real_run(root: Path, steps: int) -> tuple[str, Workload]:
    """Train the digits example for ``steps`` steps under ``root``, register it as ``digits`` v1;
    return the store's URL and what it offers to ask."""
    from govray.config.experiment import load_experiment
    from govray.platform.registry.register import register
    from govray.platform.run.preflight import check_policy, ingest_experiment
    from govray.platform.run.runner import run_trial
    from govray.tracking.lineage import checkpoints, ledger_rows

    shutil.copytree(EXAMPLE / "data", root / "data")
    raw = yaml.safe_load((EXAMPLE / "experiment.yaml").read_text())
    raw["policy"] = {
        "file": str(REPO / "policies" / "digits.policy.yaml"),
        "trust": str(REPO / "policies" / "trust.yaml"),
    }
    raw["storage_path"] = str(root / "storage")
    raw["resources"] = {"workers": 1, "cpus_per_worker": 1}
    raw["searcher"] = {"name": "single", "max_length": {"batches": steps}}
    path = root / "experiment.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_experiment(path)
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    experiment, ingested = ingest_experiment(config, checked, store)
    outcome = run_trial(config, checked, experiment, ingested.root, store)
    final = checkpoints(store, outcome.trial_id)[-1]
    register(store, "digits", Path(final.path))
    corpora = store.list_corpora(experiment.id)  # type: ignore[arg-type]
    workload = Workload(
        lineage=_lineage_paths([("digits", 1)], [final.id or 0], ["hidden", "adapter:pii-lora"]),
        influence=[f"/api/corpora/{c.corpus_id}/influence" for c in corpora],
        rows=[
            f"/api/corpora/{c.corpus_id}/rows/{row}" for c in corpora for row in range(0, c.rows, c.rows // 8)
        ],
        ledger_rows=len(ledger_rows(store, outcome.trial_id)),
    )
    store.close()
    return config.database_url, workload


def add_synthetic(url: str, experiments: int, trials: int, checkpoints: int, seed: int = 0) -> Workload:
    """Bulk-insert the synthetic experiments into the store at ``url``."""
    store = TrackingStore.open(url)
    generator = random.Random(seed)
    now = datetime.now(UTC)
    pool = [f"corpus-{i:03d}" for i in range(CORPUS_POOL)]
    versions: list[tuple[str, int]] = []
    finals: list[int] = []
    ledger = 0
    reached: set[str] = set()
    with store.engine.begin() as connection:
        next_id = {
            table: _next_id(connection, table) for table in (Experiment, TrialRecord, CheckpointRecord)
        }
        for e in range(experiments):
            experiment_id = next_id[Experiment] + e
            picked = [pool[(e * 7 + k) % CORPUS_POOL] for k in range(CORPORA_PER_EXPERIMENT)]
            reached.update(picked)
            _experiment(connection, experiment_id, picked, now)
            for t in range(trials):
                trial_id = next_id[TrialRecord] + e * trials + t
                first = next_id[CheckpointRecord] + (e * trials + t) * checkpoints
                _trial(connection, experiment_id, trial_id, first, checkpoints, now)
                rows = list(_ledger(trial_id, picked, generator))
                for start in range(0, len(rows), BATCH):
                    connection.execute(insert(LedgerRow), rows[start : start + BATCH])
                ledger += len(rows)
                finals.append(first + checkpoints - 1)
                if t == 0:
                    name, number = MODELS[e % len(MODELS)], e // len(MODELS) + 1
                    _version(connection, name, number, first + checkpoints - 1, now)
                    versions.append((name, number))
    store.close()
    layers = ["0", str(LAYERS // 2), str(LAYERS - 1), "adapter:lora"]
    return Workload(
        lineage=_lineage_paths(versions, finals, layers),
        influence=[f"/api/corpora/{corpus}/influence" for corpus in sorted(reached)],
        ledger_rows=ledger,
    )


def _next_id(connection: Connection, table: Any) -> int:
    return int(connection.execute(select(func.coalesce(func.max(table.id), 0))).scalar_one()) + 1


def _experiment(connection: Connection, experiment_id: int, corpora: list[str], now: datetime) -> None:
    config = {"name": f"search-{experiment_id}", "corpora": corpora}
    connection.execute(
        insert(Experiment),
        [
            {
                "id": experiment_id,
                "name": config["name"],
                "description": "synthetic (lineage_load benchmark)",
                "config_json": json.dumps(config),
                "config_digest": f"{experiment_id:064x}",
                "policy_digest": f"{experiment_id + 1:064x}",
                "storage_path": f"/synthetic/{experiment_id}",
                "state": "completed",
                "created_at": now,
                "updated_at": now,
            }
        ],
    )
    credentials = [
        {"license_class": "licensed", "jurisdiction": "EU", "sensitivity": "confidential"},
        {"license_class": "permissive", "jurisdiction": "US", "sensitivity": "public"},
        {"license_class": "proprietary", "jurisdiction": "DE", "sensitivity": "pii"},
    ]
    connection.execute(
        insert(CorpusRecord),
        [
            {
                "experiment_id": experiment_id,
                "corpus_id": corpus,
                "role": "train",
                "fingerprint": hashlib.sha256(corpus.encode()).hexdigest(),
                "rows": 100_000,
                "train_rows": 90_000,
                "holdout_rows": 10_000,
                "credential_json": json.dumps(
                    {"corpus_id": corpus, "source_type": "crawled", **credentials[k % len(credentials)]}
                ),
                "route_counts_json": json.dumps({ROUTES[k]: 90_000}),
                "created_at": now,
            }
            for k, corpus in enumerate(corpora)
        ],
    )


def _trial(
    connection: Connection, experiment_id: int, trial_id: int, first: int, checkpoints: int, now: datetime
) -> None:
    connection.execute(
        insert(TrialRecord),
        [
            {
                "id": trial_id,
                "experiment_id": experiment_id,
                "hparams_json": json.dumps({"lr": 10 ** -(trial_id % 4 + 1)}),
                "seed": trial_id,
                "state": "completed",
                "ray_run_name": f"search-{experiment_id}-trial{trial_id}",
                "created_at": now,
                "ended_at": now,
            }
        ],
    )
    connection.execute(
        insert(CheckpointRecord),
        [
            {
                "id": first + c,
                "trial_id": trial_id,
                "uuid": f"{trial_id:016x}{c:016x}",
                "path": f"/synthetic/{experiment_id}/trial{trial_id}/checkpoint_{c:08d}",
                "step": (c + 1) * 1000,
                "manifest_digest": f"{first + c:064x}",
                "state": "active",
                "metrics_json": "{}",
                "created_at": now,
            }
            for c in range(checkpoints)
        ],
    )
    connection.execute(
        insert(Metric),
        [
            {"trial_id": trial_id, "step": (c + 1) * 1000, "kind": "validation", "name": name, "value": 0.5}
            | {"recorded_at": now}
            for c in range(checkpoints)
            for name in ("validation_loss", "memorization_score", "memorization_flagged")
        ],
    )


def _ledger(trial_id: int, corpora: list[str], generator: random.Random) -> Iterator[dict[str, Any]]:
    """One trial's ledger: each corpus's examples, tokens and steps on every tensor its route reaches."""
    for corpus, route in zip(corpora, ROUTES, strict=True):
        examples = generator.randrange(10_000, 1_000_000)
        steps = examples // 64
        if route == "adapter":
            targets = range(ADAPTER_TENSORS // 2)
            tensors: list[tuple[str, int | None]] = [
                (f"adapter/lora/layers.{i}.lora_{ab}", None) for i in targets for ab in "AB"
            ]
        else:
            low = 0 if route == "all" else LAYERS // 2
            tensors = [(f"layers.{i}.t{j}", i) for i in range(low, LAYERS) for j in range(TENSORS_PER_LAYER)]
        for tensor, layer in tensors:
            yield {
                "trial_id": trial_id,
                "checkpoint_id": None,
                "corpus_id": corpus,
                "parameter": tensor,
                "layer_index": layer,
                "examples": examples,
                "tokens": examples * 128,
                "steps": steps,
            }


def _version(connection: Connection, name: str, number: int, checkpoint_id: int, now: datetime) -> None:
    if number == 1:
        connection.execute(
            insert(RegisteredModel), [{"name": name, "description": "synthetic", "created_at": now}]
        )
    connection.execute(
        insert(ModelVersion),
        [
            {
                "model_name": name,
                "version": number,
                "checkpoint_id": checkpoint_id,
                "tags_json": "{}",
                "created_at": now,
            }
        ],
    )
