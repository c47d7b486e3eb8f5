"""The main demo: a governed 2-worker run of the digits example on local Ray + SQLite.

It creates this machine's platform keys if it has none (``govray keys init``), verifies the signed
depth policy and shows which parameters each corpus may update, ingests
the three credentialed corpora with Ray Data into route-partitioned shards, trains on two Ray Train
workers with the governance-aware allreduce (progress bar), prints validation accuracy and the
per-corpus x per-layer ledger, and lists the experiment in the embedded tracking store. Then the
compliance side: registers the trained model (attested), makes a version without the PII adapter
(attested with the corpus it excludes), trusts this machine's platform key in
``STORAGE/trust.yaml`` (the trust file ``govray serve --trust`` verifies the demo's attestations
with), answers an erasure request for one PII row, and prints the EU AI Act training-content
summary of the clean version.

Run from the repository root: ``python -m jobs.demo``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from govray.cli import main
from govray.config.experiment import load_experiment
from govray.platform.registry.versions import resolve
from govray.tracking.lineage import checkpoints
from govray.tracking.store import TrackingStore

EXPERIMENT = Path(__file__).resolve().parent / "examples" / "digits" / "experiment.yaml"
POLICY_TRUST = Path(__file__).resolve().parents[1] / "policies" / "trust.yaml"


def demo() -> int:
    steps = [
        ("this machine's platform keys, created once (explicitly)", ["keys", "init", "--exist-ok"]),
        ("the signed policy, resolved against the model", ["policy", "check", str(EXPERIMENT)]),
        ("ingest and governed training on 2 Ray Train workers", ["run", str(EXPERIMENT)]),
        ("the experiment in the tracking store", ["experiment", "list", "--config", str(EXPERIMENT)]),
    ]
    code = _run(steps)
    if code:
        return code
    config = load_experiment(EXPERIMENT)
    store = TrackingStore.open(config.database_url)
    trial = store.list_trials(store.get_experiment(config.name).id or 0)[-1]
    final = [c for c in checkpoints(store, trial.id or 0) if c.state == "active"][-1]
    db = ["--database", config.database_url]
    code = _run(
        [
            (
                "register the trained model (verified, attested)",
                ["model", "register", "digits", final.path, *db],
            )
        ]
    )
    if code:
        return code
    trained = f"digits:{resolve(store, 'digits').version}"
    trust = Path(config.storage_path) / "trust.yaml"  # what `govray serve --trust` verifies the demo with
    return _run(
        [
            (
                "trust this machine's platform key, which signed the demo's attestations",
                ["keys", "trust-platform", "--trust", str(trust), "--from", str(POLICY_TRUST)],
            ),
            (
                "a version without the PII adapter, attested with the corpus it excludes",
                ["model", "remove-adapter", trained, "--adapter", "pii-lora", *db],
            ),
            (
                "an erasure request: which steps, tensors and versions did PII row 0 reach?",
                ["lineage", "row", "digits-writers", "0", *db],
            ),
            (
                "the EU AI Act training-content summary of the clean version",
                ["export", "eu-summary", "digits", "--format", "md", *db],
            ),
        ]
    )


def _run(steps: list[tuple[str, list[str]]]) -> int:
    for title, argv in steps:
        print(f"\n== {title}: govray {' '.join(argv)}", flush=True)
        code = main(argv)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(demo())
