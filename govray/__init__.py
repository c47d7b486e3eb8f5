"""govray: governed deep-learning training on Ray.

The public API is below; everything else is reached through its layer's package. The packages,
bottom to top (a package imports only its own and lower ones; ``tests/test_layering.py`` holds the
list and enforces it, and checks this docstring and README's layout against it):

    core → governance → config → data → train → tracking → provenance → signer → platform → queries → cli

Names are imported on first use, so ``import govray`` stays cheap (no torch, no Ray). A run, as
``govray run`` does it::

    config = govray.load_experiment(Path("jobs/examples/digits/experiment.yaml"))
    store = govray.TrackingStore.open(config.database_url)
    checked = govray.check_policy(config, store, allow_unsigned=False)   # signed policy, routing
    experiment, ingested = govray.ingest_experiment(config, checked, store)
    outcome = govray.run_trial(config, checked, experiment, ingested.root, store)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from govray.core.version import GOVRAY_VERSION

__version__ = GOVRAY_VERSION

PUBLIC_API = {
    # writing a trial
    "Trial": "govray.train.trial",
    "Batch": "govray.train.trial",
    "Predictions": "govray.train.trial",
    "ProbeHooks": "govray.train.trial",
    "scoring": "govray.train.trial",
    "TrainingSettings": "govray.config.training",
    # loading an experiment and its signed policy, opening the store
    "ExperimentConfig": "govray.config.experiment",
    "load_experiment": "govray.config.experiment",
    "check_policy": "govray.platform.run.preflight",
    "ingest_experiment": "govray.platform.run.preflight",
    "TrackingStore": "govray.tracking.store",
    # running, searching, resuming, replaying
    "run_trial": "govray.platform.run.runner",
    "resume_trial": "govray.platform.rerun.resume",
    "run_search": "govray.platform.search.driver",
    "replay_trial": "govray.platform.rerun.replay",
    # attesting and verifying; asking the store
    "attest": "govray.signer.attesting",
    "verify_attestation": "govray.provenance.verify",
    "StoreReader": "govray.queries",
    "GovrayError": "govray.core.errors",
    "ConfigError": "govray.core.errors",
}
__all__ = sorted(PUBLIC_API)

if TYPE_CHECKING:
    from govray.config.experiment import ExperimentConfig, load_experiment
    from govray.config.training import TrainingSettings
    from govray.core.errors import ConfigError, GovrayError
    from govray.platform.rerun.replay import replay_trial
    from govray.platform.rerun.resume import resume_trial
    from govray.platform.run.preflight import check_policy, ingest_experiment
    from govray.platform.run.runner import run_trial
    from govray.platform.search.driver import run_search
    from govray.provenance.verify import verify_attestation
    from govray.queries import StoreReader
    from govray.signer.attesting import attest
    from govray.tracking.store import TrackingStore
    from govray.train.trial import Batch, Predictions, ProbeHooks, Trial, scoring


def __getattr__(name: str) -> Any:
    if name not in PUBLIC_API:
        raise AttributeError(f"module 'govray' has no attribute '{name}'")
    return getattr(importlib.import_module(PUBLIC_API[name]), name)
