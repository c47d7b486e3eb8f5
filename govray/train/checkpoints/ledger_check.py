"""The signer's recomputation of a checkpoint's ledger before it seals it.

A worker writes its checkpoint's ``state.json``, ledger included; a trial that wanted to hide which
corpora reached which tensors would write a smaller one. So before signing, the signer recomputes
the ledger of steps ``0..step-1`` from what the same folder holds — the state's schedule (every
input of it, rollbacks included; its digest checked) and the routing of the run's spec
(``run.json``) — plus, for a run started from another checkpoint, that checkpoint's ledger as its
own signed manifest lists it, and refuses a folder whose ledger differs, naming the first
differences. No trial code runs: examples come from the schedule (one a row) or, for packed data,
from the packed store's window records (its manifest checked against the digest in the run spec,
each part against the manifest as it is read); tokens are compared where they are data (packed
windows), not where the trial's ``tokens`` hook counted them — those are checked by ``govray
verify --recompute-ledger``, which runs the trial, and by re-execution.

The state and run spec read here are the bytes the manifest lists (read again and refused if their
sha256 differs from the hashing pass's); the run spec is the one the run was launched with (the
signer compares its sha256 with the one its capability was opened with before this check runs).
``LedgerCheck`` keeps each packed store it opened (a part is hashed once per signer) and, per run
spec, the ledger of the last steps it recomputed: a run's next seal recomputes only the steps after
them when the new schedule agrees on the earlier ones (``ScheduleSpec.agrees_before``: no gate or
rollback reaching back before them), so sealing a run costs its length once, not at every seal.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from govray.core.canonical import file_sha256
from govray.core.errors import GovrayError, describe_validation_error
from govray.core.keys import TrustConfig
from govray.data.packed import MANIFEST as PACKED_MANIFEST
from govray.data.packed import PackedStore
from govray.data.schedule import ScheduleError, ScheduleSpec
from govray.governance.routing import RoutingTable
from govray.train.checkpoints.manifest import STATE_FILE, CheckpointState, recorded_state
from govray.train.checkpoints.sealing import SealRefused
from govray.train.runspec import RUN_SPEC_FILE, parse_run_spec
from govray.train.step.ledger import Ledger, LedgerEntry, RowCounts, recompute_ledger

MAX_REPORTED = 3  # differences named in a refusal
MAX_RUNS_KEPT = 256  # runs whose last recomputed ledger the check keeps (a few kB each)


@dataclass(frozen=True)
class _Computed:
    """The ledger of steps ``0..steps-1`` of a run (no source merged), under ``schedule``."""

    schedule: ScheduleSpec
    steps: int
    ledger: Ledger


class LedgerMismatch(SealRefused):
    """A checkpoint's ledger is not the one its schedule and routing give (the message says where)."""


def expected_ledger(
    schedule: ScheduleSpec,
    routing: RoutingTable,
    steps: int,
    counts: RowCounts | None,
    source: Ledger | None = None,
) -> Ledger:
    """The ledger of a run's steps ``0..steps-1``: recomputed from its schedule and routing, after
    the ledger of the checkpoint it started from (``source``), if any."""
    recomputed = recompute_ledger(schedule, routing, steps, counts)
    return source.merge(recomputed) if source is not None else recomputed


def ledger_differences(
    claimed: Mapping[tuple[str, str], LedgerEntry],
    computed: Ledger,
    tokens: bool = True,
    said: str = "claimed",
) -> list[str]:
    """Where ``claimed`` and ``computed`` differ, entry by entry (``tokens``: compare token counts
    too; ``said``: what the claim is called, "claimed" or "attested"); empty when they agree."""
    problems = []
    for key in sorted(set(claimed) | set(computed.entries)):
        mine, theirs = claimed.get(key), computed.entries.get(key)
        if not tokens and mine is not None and theirs is not None:
            mine = LedgerEntry(mine.examples, 0, mine.steps)
            theirs = LedgerEntry(theirs.examples, 0, theirs.steps)
        if mine != theirs:
            problems.append(f"{key[0]} → {key[1]}: {said} {_counts(mine)}, recomputed {_counts(theirs)}")
    return problems


def _counts(entry: LedgerEntry | None) -> str:
    if entry is None:
        return "nothing"
    return json.dumps({"examples": entry.examples, "tokens": entry.tokens, "steps": entry.steps})


class LedgerCheck:
    """``check(folder, files, read)``: refuse (``LedgerMismatch``) a checkpoint folder whose
    ``state.json`` ledger is not the recomputed one. ``files``: the folder's files by the sha256
    the sealer computed; ``read(name)``: a file's bytes as the sealer opens them. ``trust_of``:
    the operator's trust (a source checkpoint's manifest is verified under it)."""

    def __init__(self, trust_of: Callable[[], TrustConfig]) -> None:
        self._trust_of = trust_of
        self._lock = threading.Lock()
        self._reading = threading.Lock()
        self._stores: dict[tuple[str, str], PackedStore] = {}
        self._last: OrderedDict[str, _Computed] = OrderedDict()  # by run spec sha256, latest last

    def __call__(self, folder: Path, files: Mapping[str, str], read: Callable[[str], bytes]) -> None:
        try:
            self._check(folder, files, read)
        except SealRefused:
            raise
        except GovrayError as error:  # a malformed ledger or run spec, an unreadable packed part
            raise LedgerMismatch(f"{folder}: its ledger cannot be recomputed: {error}") from None

    def _check(self, folder: Path, files: Mapping[str, str], read: Callable[[str], bytes]) -> None:
        try:
            state = CheckpointState.model_validate_json(_listed(folder, files, STATE_FILE, read))
        except ValidationError as error:
            raise LedgerMismatch(
                f"{folder / STATE_FILE}: not a checkpoint's state ({describe_validation_error(error)})"
            ) from None
        if RUN_SPEC_FILE not in files:
            raise LedgerMismatch(f"{folder}: holds no {RUN_SPEC_FILE}: its ledger cannot be recomputed")
        spec = parse_run_spec(_listed(folder, files, RUN_SPEC_FILE, read), folder / RUN_SPEC_FILE)
        try:
            schedule = ScheduleSpec.from_json(state.schedule)
        except (KeyError, TypeError, ValueError, ScheduleError) as error:
            raise LedgerMismatch(f"{folder}: its state's schedule is unreadable: {error}") from None
        if schedule.digest() != state.schedule_digest:
            raise LedgerMismatch(f"{folder}: its state's schedule does not hash to its schedule_digest")
        source = self._source(state)
        counts = self._packed(spec.packed_root, spec.packed_sha256) if spec.packed_root else None
        computed = self._recomputed(files[RUN_SPEC_FILE], schedule, spec.routing, state.step, counts)
        if source is not None:
            computed = source.merge(computed)
        claimed = Ledger.from_json(state.ledger).entries
        if problems := ledger_differences(claimed, computed, tokens=counts is not None):
            shown = "; ".join(problems[:MAX_REPORTED])
            more = f" (and {len(problems) - MAX_REPORTED} more)" if len(problems) > MAX_REPORTED else ""
            raise LedgerMismatch(
                f"{folder}: its ledger is not the one recomputed from its schedule and the run's "
                f"routing: {shown}{more}"
            )

    def _recomputed(
        self,
        spec_sha256: str,
        schedule: ScheduleSpec,
        routing: RoutingTable,
        steps: int,
        counts: RowCounts | None,
    ) -> Ledger:
        """The ledger of steps ``0..steps-1`` under ``schedule``: the steps after the last one this
        check computed under the same run spec, merged into that ledger, when the schedules agree
        on the steps before it (a run's seals move forward; a rollback reaching back, or a
        checkpoint of an earlier step, is recomputed from step 0)."""
        with self._lock:
            last = self._last.get(spec_sha256)
        start, before = 0, Ledger()
        if last is not None and last.steps <= steps and last.schedule.agrees_before(schedule, last.steps):
            start, before = last.steps, last.ledger
        # (a packed store's part maps are opened on first read: one seal reads it at a time)
        with self._reading if counts is not None else contextlib.nullcontext():
            computed = before.merge(recompute_ledger(schedule, routing, steps, counts, start=start))
        with self._lock:
            self._last[spec_sha256] = _Computed(schedule, steps, computed)
            self._last.move_to_end(spec_sha256)
            while len(self._last) > MAX_RUNS_KEPT:
                self._last.popitem(last=False)
        return computed

    def _source(self, state: CheckpointState) -> Ledger | None:
        if not state.source:
            return None
        path = Path(str(state.source.get("path", "")))
        digest = str(state.source.get("manifest_sha256", ""))
        try:
            return Ledger.from_json(recorded_state(path, digest, self._trust_of()).ledger)
        except GovrayError as error:
            raise LedgerMismatch(
                f"the run started from checkpoint {path}, whose ledger is needed: {error}"
            ) from None

    def _packed(self, root: str, sha256: str) -> PackedStore:
        with self._lock:
            if (root, sha256) not in self._stores:
                path = Path(root)
                try:
                    found = file_sha256(path / PACKED_MANIFEST)
                except OSError as error:
                    raise LedgerMismatch(
                        f"the signer cannot read packed store {root} (the ledger's counts): {error.strerror}"
                    ) from None
                if found != sha256:
                    raise LedgerMismatch(f"packed store {root}: its manifest is not the one the run recorded")
                self._stores[(root, sha256)] = PackedStore.open(path, verify="touched")
            return self._stores[(root, sha256)]


def _listed(folder: Path, files: Mapping[str, str], name: str, read: Callable[[str], bytes]) -> bytes:
    content = read(name)
    if hashlib.sha256(content).hexdigest() != files.get(name):
        raise LedgerMismatch(f"{folder / name}: changed while the sealer read it")
    return content
