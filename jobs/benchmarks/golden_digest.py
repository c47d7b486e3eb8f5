"""The golden runs, digested: proof that a restructuring changed no behaviour.

Runs the runs the tests rely on, each from scratch in a temporary directory on local Ray, and
prints the sha256 of every file of each run's final checkpoint that holds numbers (base model,
adapters, optimizer tensors and settings), of its ledger rows, of its recorded decisions and of
its metric values (name, step, value), one line each:

1. ``ddp-adapter``: 2 Ray Train workers, the digits example with its PII LoRA adapter, 30 steps,
   dropout, SGD, per-route-group clipping, a metric-driven LR schedule (decisions at 20 and 30).
2. ``replay``: that run replayed without the PII corpus (its decisions applied, not retaken).
3. ``rollback``: one worker in-process, a memorizing configuration (random labels on the public
   corpus) under a rollback policy: memorization flags, rollbacks to a clean state and gates.
4. ``rollback-replay``: that run replayed without the licensed corpus (rollbacks applied).
5. ``search-local``: a one-point grid search, a 1-worker Tune trial.
6. ``search-segmented``: the same with 2 workers: Ray Train segments inside the Tune trial.

Run: ``python -m jobs.benchmarks.golden_digest [--only NAME ...]``. Identical output before and
after a change is the proof (the data are the digits that scikit-learn ships, split by the
example's ``data/`` files; the rollback run shuffles one corpus's labels with a fixed seed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from jobs.examples.digits.golden import (
    GOLDEN_HPARAMS,
    MEMORIZER,
    golden_example,
    opened,
    with_random_labels,
)

NUMBER_FILES = ("model.safetensors", "optimizer.safetensors", "optimizer.json")
CONTROL_METRICS = ("early_stopped", "stopped_on_request")  # control signals, not measurements


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def trained(path: Path, report_every: int) -> tuple[Any, int]:
    from govray.platform.run.runner import run_trial

    config, store, checked, experiment, ingested = opened(path)
    outcome = run_trial(config, checked, experiment, ingested.root, store, report_every=report_every)
    return store, outcome.trial_id


def searched(path: Path) -> tuple[Any, int]:
    from govray.platform.search.driver import run_search

    config, store, checked, experiment, ingested = opened(path)
    outcome = run_search(config, checked, experiment, ingested.root, store, report_every=5)
    (trial_id,) = outcome.trial_ids
    return store, trial_id


def replayed(store: Any, experiment: str, trial_id: int, exclude: str) -> int:
    from govray.platform.rerun.replay import replay_trial

    replay = replay_trial(store, experiment, (exclude,), trial_id=trial_id)
    trial: int = replay.outcome.trial_id
    return trial


def digest(name: str, store: Any, trial_id: int) -> list[str]:
    """One line per digested item of the trial's final checkpoint and record."""
    from govray.tracking.lineage import checkpoints, ledger_rows

    final = Path([c for c in checkpoints(store, trial_id) if c.state == "active"][-1].path)
    lines = []
    files = sorted(p.name for p in final.iterdir() if p.name in NUMBER_FILES or p.name.startswith("adapter-"))
    for file in files:
        lines.append(f"{name} {file} {sha256((final / file).read_bytes())}")
    ledger = [
        [r.corpus_id, r.parameter, r.layer_index, r.examples, r.tokens, r.steps]
        for r in ledger_rows(store, trial_id)
    ]
    decisions = [
        [d.seq, d.kind, d.step, json.loads(d.payload_json), d.replayed] for d in store.decisions(trial_id)
    ]
    metrics = sorted(
        (m.name, m.step, repr(m.value)) for m in store.metrics(trial_id) if m.name not in CONTROL_METRICS
    )
    for label, value in (("ledger", ledger), ("decisions", decisions), ("metrics", metrics)):
        lines.append(f"{name} {label} {sha256(json.dumps(value, sort_keys=True).encode())}")
    kinds = [d[1] for d in decisions]
    lines.append(f"{name} summary steps={max(m[1] for m in metrics)} decisions={kinds}")
    return lines


def golden_ddp(root: Path) -> list[str]:
    path = golden_example(root, 2, {"batches": 30}, GOLDEN_HPARAMS, keep_checkpoints=1000)
    store, trial_id = trained(path, report_every=10)
    lines = digest("ddp-adapter", store, trial_id)
    lines += digest("replay", store, replayed(store, "digits-governed", trial_id, "digits-writers"))
    return lines


def golden_rollback(root: Path) -> list[str]:
    from govray.core.keys import KeyRole, SigningKey, TrustConfig, save_trust
    from govray.governance.policy import sign_policy

    path = golden_example(
        root,
        1,
        {"batches": 900},
        MEMORIZER,
        keep_checkpoints=1000,
        lr_schedule=False,
        min_validation_period=150,
    )
    key = SigningKey.generate(KeyRole.POLICY_AUTHORITY)
    policy = root / "policies" / "digits.policy.yaml"
    document = yaml.safe_load(policy.read_text())
    document["memorization"] = {"loss_gap": 0.5, "action": "rollback"}
    policy.write_text(yaml.safe_dump(document, sort_keys=False))
    policy.with_name(policy.name + ".sig").write_text(sign_policy(policy, key).to_json())
    save_trust(TrustConfig(keys=[key.public_key]), root / "policies" / "trust.yaml")
    public = root / "data" / "public.parquet"
    pq.write_table(with_random_labels(pq.read_table(public)), public)
    store, trial_id = trained(path, report_every=150)
    lines = digest("rollback", store, trial_id)
    lines += digest("rollback-replay", store, replayed(store, "digits-governed", trial_id, "digits-licensed"))
    return lines


def golden_search(root: Path, workers: int) -> list[str]:
    hparams = {**GOLDEN_HPARAMS, "dropout": 0.0}
    path = golden_example(
        root,
        workers,
        {"batches": 20},
        hparams,
        keep_checkpoints=1000,
        lr_schedule=False,
        searcher={"name": "grid", "metric": "validation_loss", "max_length": {"batches": 20}},
        min_validation_period=10,  # two validations: two segments of a 2-worker trial
    )
    store, trial_id = searched(path)
    return digest("search-local" if workers == 1 else "search-segmented", store, trial_id)


RUNS = {
    "ddp": golden_ddp,
    "rollback": golden_rollback,
    "search-local": lambda root: golden_search(root, 1),
    "search-segmented": lambda root: golden_search(root, 2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS), default=list(RUNS))
    args = parser.parse_args()
    import os

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from govray.core.runtime import ensure_ray

    ensure_ray()
    lines = []
    for name in args.only:
        with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as scratch:
            lines += RUNS[name](Path(scratch))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
