"""How the driver fits a Ray Train run it keeps an eye on: ``fit_polled``, the one way.

``TorchTrainer.fit`` blocks until the run ends, while the driver has work to do as it trains: a
run's driver takes rank 0's reports from its sink, records and shows them and passes a pause or
kill request to rank 0 (``govray.platform.run.runner``); a search trial's Tune actor relays each
validation to Tune (``govray.platform.search.tune_trial``). Both fit through ``fit_polled``: the fit
runs in a thread and ``look`` here every ``period`` seconds, once more after the fit ended, and the
fit's error is raised here. When ``look`` raises (Tune stopped the trial: ``SystemExit``) the fit is
still running: ``abandon`` ends it (rank 0 asked to stop, its placement group removed).

Example::

    result = fit_polled(trainer.fit, take_reports, period=0.5, name="govray-fit")
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

Fitted = TypeVar("Fitted")
logger = logging.getLogger(__name__)


def fit_polled(
    fit: Callable[[], Fitted],
    look: Callable[[], None],
    *,
    period: float,
    name: str,
    abandon: Callable[[], None] | None = None,
) -> Fitted:
    """``fit()`` in a thread called ``name`` while ``look()`` runs here every ``period`` seconds
    and once after the fit ended; returns what the fit returned, or raises what it raised (a last
    look that fails after the fit failed is logged: the fit's error is the one raised). If ``look``
    raises while the fit runs, ``abandon()`` is called before the exception goes on."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = fit()
        except BaseException as error:  # raised again in the driver's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        ended = False
        while not ended:
            thread.join(timeout=period)
            ended = not thread.is_alive()
            try:
                look()  # (once more after the end: what the fit did last)
            except Exception as error:
                if not (ended and "error" in outcome):
                    raise
                # The fit failed first: its error is the one to tell (the last look's is logged).
                logger.warning("after the fit failed, its last look failed too: %s", error)
    finally:
        if thread.is_alive() and abandon is not None:
            abandon()
    if "error" in outcome:
        raise outcome["error"]
    fitted: Fitted = outcome["result"]
    return fitted


def pass_request(control: Path, request: str) -> None:
    """Leave ``request`` (``pause``, ``kill``) in the run's control file, where rank 0 reads it at
    its next look; written whole (rank 0 never reads half a word)."""
    control.parent.mkdir(parents=True, exist_ok=True)
    scratch = control.with_suffix(".tmp")
    scratch.write_text(request)
    scratch.replace(control)
