"""A governed digits run trained to memorize (or not), maybe under a memorization policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from govray.config.experiment import load_experiment
from govray.core.keys import SigningKey, TrustConfig, save_trust
from govray.platform.run.preflight import check_policy, ingest_experiment
from govray.platform.run.runner import TrialOutcome, run_trial
from govray.tracking.store import TrackingStore
from jobs.examples.digits.golden import golden_example as golden_example_at
from jobs.examples.digits.golden import with_random_labels
from tests.helpers.builders import write_signed_policy


def trained(
    root: Path,
    hparams: dict[str, Any],
    steps: int,
    random_labels: bool,
    validate_every: int | None = None,
    policy: tuple[SigningKey, TrustConfig, dict[str, Any]] | None = None,
    resources: dict[str, Any] | None = None,
    keep_latest: int = 1000,
) -> tuple[TrialOutcome, TrackingStore]:
    path = golden_example_at(
        root,
        workers=1,
        max_length={"batches": steps},
        hparams=hparams,
        lr_schedule=False,
        **({"resources": resources} if resources else {}),
    )
    if policy is not None:  # the example policy plus a memorization section, signed by a test authority
        key, trust, memorization = policy
        document = yaml.safe_load((root / "policies" / "digits.policy.yaml").read_text())
        write_signed_policy(
            root / "policies", {**document, "memorization": memorization}, key, name="digits.policy"
        )
        save_trust(trust, root / "policies" / "trust.yaml")
    if random_labels:
        public = root / "data" / "public.parquet"
        pq.write_table(with_random_labels(pq.read_table(public)), public)
    raw = yaml.safe_load(path.read_text())
    raw["min_validation_period"] = validate_every or steps  # by default one validation, at the end
    raw["checkpoint"]["save_trial_latest"] = keep_latest  # by default tests read every one
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    config = load_experiment(path)
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    experiment, ingested = ingest_experiment(config, checked, store)
    outcome = run_trial(
        config, checked, experiment, ingested.root, store, report_every=validate_every or steps
    )
    return outcome, store
