"""The schedule: which route and which rows each worker reads at each step — a pure function.

Nothing random is carried across calls: every slot is recomputed from the spec alone (seed,
world size, batch size, per-route row counts, excluded corpora, recorded governance events, the
schedule version), so resume, replay and a verifier all see the same schedule.

Semantics of epoch ``e``:

1. Every route's rows ``0..n-1`` (positions in ``shards/train/ROUTE``) are permuted by a bijection
   keyed by ``derive_seed(seed, e, route)`` — keyed by the route's name, so adding a route never
   moves another's rows. Position ``p`` of the permuted route holds row ``order(p)``.
2. Each permuted route is cut into batches of ``batch_size`` positions; the last may be short, so
   no row is dropped. A batch holds rows of one route only.
3. All batches of all routes (policy order, then batch order) — ``B`` of them — are put in one
   order by a bijection on ``[0, B)`` keyed by ``derive_seed(seed, e)``.
4. ``steps_per_epoch = ceil(B / world_size)``. At step ``s`` slot ``i`` holds batch
   ``s * world_size + i`` of that order, or is empty (route ``None``) past the end.
   ``global_step = e * steps_per_epoch + s``. ``world_size`` is the number of slots per step:
   the run's world size when it started, fixed for the run (the JSON key keeps its name, so
   every recorded spec and digest stays as it was). A world of W workers splits each step's
   slots among its ranks (``govray.data.slots.rank_slots``); with W = world_size slot ``i`` is
   rank ``i``'s.
5. Exclusions and gates are a post-filter: the slot is computed as without them, then rows of an
   excluded corpus, or of a corpus gated by an event with ``event.step <= global_step``, are
   dropped (the route stays set). Excluding corpus X therefore leaves every other slot of every
   step bit-for-bit the same, which the counterfactual replay relies on.

The bijections of steps 1 and 3 are ``KeyedPermutation``s, Feistel networks with cycle-walking,
never materialised. A step evaluates only its ``world_size`` batches: O(1) memory in the route
sizes, so a route of 10^9 rows costs what one of 10^3 does, and a row's steps are found through the
inverses without building an epoch (``row_slots``). They are stable across numpy versions and
platforms; ``hash()`` is never used. A schedule records its ``version`` (``SCHEDULE_VERSION``, 2:
the numbering goes on from the pre-release one); a schedule of any other version is refused, never
recomputed another way. This module holds
the inputs (``ScheduleSpec``); what they give each worker at each step, and a row's steps, are
:mod:`govray.data.slots`; a whole step's slots summed by route, without an object per rank,
:func:`govray.data.step_rows.step_rows`.
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Literal

import numpy as np

from govray.core.canonical import canonical_json, sha256_hex
from govray.core.errors import GovrayError
from govray.data.orders import Sizes
from govray.data.permutation import derive_seed as derive_seed  # the schedule's keys, named here
from govray.data.shards import ShardManifest

SCHEDULE_VERSION = 2  # the one version this govray computes and reads


class ScheduleError(GovrayError):
    """The schedule's inputs are inconsistent (a world size below 1, a gate on an unknown corpus, ...)."""


def _check_version(version: object) -> None:
    if version != SCHEDULE_VERSION:
        raise ScheduleError(
            f"schedule version {version!r} is not the one this govray computes ({SCHEDULE_VERSION})"
        )


@dataclass(frozen=True)
class RouteLayout:
    """One route's training rows: ``(corpus_id, rows)`` in shard order (corpus order, then row)."""

    route: str
    corpus_counts: tuple[tuple[str, int], ...]
    _ends: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "corpus_counts", tuple((c, int(n)) for c, n in self.corpus_counts))
        corpora = [corpus for corpus, _ in self.corpus_counts]
        if len(set(corpora)) != len(corpora):
            raise ScheduleError(f"route '{self.route}' lists a corpus twice: {', '.join(corpora)}")
        negative = [corpus for corpus, rows in self.corpus_counts if rows < 0]
        if negative:
            raise ScheduleError(f"route '{self.route}': negative row count for {', '.join(negative)}")
        object.__setattr__(self, "_ends", tuple(accumulate(rows for _, rows in self.corpus_counts)))

    @property
    def rows(self) -> int:
        return self._ends[-1] if self._ends else 0

    def corpus_of(self, index: int) -> str:
        """The corpus of route-local row ``index``."""
        if not 0 <= index < self.rows:
            raise ScheduleError(f"route '{self.route}' has {self.rows} rows; no row {index}")
        return self.corpus_counts[bisect_right(self._ends, index)][0]

    def corpus_positions(self, indexes: np.ndarray) -> np.ndarray:
        """The position in ``corpus_counts`` of each row's corpus (vectorized, no names)."""
        return np.searchsorted(np.asarray(self._ends), indexes, side="right")

    def corpora_of(self, indexes: np.ndarray) -> tuple[str, ...]:
        """The corpus of each row in ``indexes`` (vectorized ``corpus_of``)."""
        return tuple(self.corpus_counts[position][0] for position in self.corpus_positions(indexes).tolist())


@dataclass(frozen=True)
class ScheduleEvent:
    """A recorded governance decision taken after ``step`` global steps.

    ``gate``: stop routing ``corpus_id``'s rows from global step ``step`` on (memorization gate,
    or the gate of a rollback). ``rollback``: the weights went back to those of the clean
    checkpoint at ``to_step``, so global steps ``to_step .. step-1`` reached nothing (their slots
    were trained, then discarded); the schedule's slots do not change.
    """

    step: int
    kind: Literal["gate", "rollback"]
    corpus_id: str = ""  # gate: the gated corpus
    to_step: int | None = None  # rollback: the clean checkpoint's step

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {"step": self.step, "kind": self.kind, "corpus_id": self.corpus_id}
        if self.to_step is not None:
            document["to_step"] = self.to_step
        return document


@dataclass(frozen=True)
class ScheduleSpec:
    """Every input of the schedule. Frozen and hashable; ``digest()`` is recorded in checkpoints."""

    seed: int
    world_size: int  # slots per step: the run's world size when it started (module docstring, 4.)
    batch_size: int  # rows per slot
    routes: tuple[RouteLayout, ...]  # in policy order; routes with 0 rows allowed
    excluded_corpora: frozenset[str] = frozenset()
    events: tuple[ScheduleEvent, ...] = ()
    version: int = SCHEDULE_VERSION  # how the rows and batches are permuted (module docstring)

    def __post_init__(self) -> None:
        object.__setattr__(self, "routes", tuple(self.routes))
        object.__setattr__(self, "excluded_corpora", frozenset(self.excluded_corpora))
        # Events are a set of decisions; a canonical order makes equal specs digest equally.
        events = sorted(self.events, key=lambda event: (event.step, event.kind, event.corpus_id))
        object.__setattr__(self, "events", tuple(events))
        self._validate()

    def _validate(self) -> None:
        _check_version(self.version)
        if self.world_size < 1:
            raise ScheduleError(f"world size must be at least 1, not {self.world_size}")
        if self.batch_size < 1:
            raise ScheduleError(f"batch size must be at least 1, not {self.batch_size}")
        names = [route.route for route in self.routes]
        if len(set(names)) != len(names):
            raise ScheduleError(f"routes repeat a name: {', '.join(names)}")
        if sum(route.rows for route in self.routes) == 0:
            raise ScheduleError(f"no training rows in any route ({', '.join(names) or 'no routes'})")
        known = {corpus for route in self.routes for corpus, _ in route.corpus_counts}
        listing = ", ".join(sorted(known))
        unknown = sorted(self.excluded_corpora - known)
        if unknown:
            raise ScheduleError(f"excluded corpus '{unknown[0]}' has no training rows (corpora: {listing})")
        for event in self.events:
            if event.kind == "rollback":
                if event.to_step is None or not 0 <= event.to_step < event.step or event.corpus_id:
                    raise ScheduleError(
                        f"rollback at step {event.step} must go back to an earlier step (to_step "
                        f"{event.to_step}) and name no corpus"
                    )
                continue
            if event.kind != "gate":
                raise ScheduleError(f"unknown schedule event kind '{event.kind}' at step {event.step}")
            if event.to_step is not None:
                raise ScheduleError(f"gate of corpus '{event.corpus_id}' at step {event.step} has a to_step")
            if event.step < 0:
                raise ScheduleError(f"gate of corpus '{event.corpus_id}' at negative step {event.step}")
            if event.corpus_id not in known:
                raise ScheduleError(
                    f"gate at step {event.step} names corpus '{event.corpus_id}', which has no "
                    f"training rows (corpora: {listing})"
                )

    @classmethod
    def from_manifest(
        cls,
        manifest: ShardManifest,
        *,
        seed: int,
        world_size: int,
        batch_size: int,
        excluded_corpora: Iterable[str] = (),
        events: Iterable[ScheduleEvent] = (),
        windows: Sequence[RouteLayout] | None = None,
    ) -> ScheduleSpec:
        """The spec of ``manifest``'s training shards (corpora in the manifest's corpus order). Under
        ``data.packing`` the positions scheduled are a packed store's ``windows`` (its layouts,
        ``PackedStore.layouts()``), not the rows."""
        order = [corpus.corpus_id for corpus in manifest.corpora]
        routes = []
        if windows is not None and [w.route for w in windows] != [r.route for r in manifest.routes]:
            raise ScheduleError(
                f"shards {manifest.key}: the packed windows' routes are not the shards' routes"
            )
        for summary in manifest.routes if windows is None else ():
            unknown = sorted(set(summary.corpus_counts) - set(order))
            if unknown:
                raise ScheduleError(
                    f"shards {manifest.key}: route '{summary.route}' counts rows of unlisted "
                    f"corpora {', '.join(unknown)}"
                )
            counts = tuple((c, summary.corpus_counts[c]) for c in order if summary.corpus_counts.get(c))
            route = RouteLayout(summary.route, counts)
            if route.rows != summary.rows:
                raise ScheduleError(
                    f"shards {manifest.key}: route '{summary.route}' has {summary.rows} rows but its "
                    f"corpus counts sum to {route.rows}"
                )
            routes.append(route)
        return cls(
            seed=seed,
            world_size=world_size,
            batch_size=batch_size,
            routes=tuple(routes) if windows is None else tuple(windows),
            excluded_corpora=frozenset(excluded_corpora),
            events=tuple(events),
        )

    @functools.cached_property
    def batches_per_epoch(self) -> int:
        return sum(math.ceil(route.rows / self.batch_size) for route in self.routes)

    @functools.cached_property
    def sizes(self) -> Sizes:
        """``(route, rows)`` of every route, in policy order: what the epoch's order depends on."""
        return tuple((route.route, route.rows) for route in self.routes)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.batches_per_epoch / self.world_size)

    def locate(self, global_step: int) -> tuple[int, int]:
        """``(epoch, step within epoch)`` of ``global_step``."""
        if global_step < 0:
            raise ScheduleError(f"global step must be non-negative, not {global_step}")
        epoch, step = divmod(global_step, self.steps_per_epoch)
        return epoch, step

    def route(self, name: str) -> RouteLayout:
        for route in self.routes:
            if route.route == name:
                return route
        raise ScheduleError(f"the schedule has no route '{name}'")

    def withheld_corpora(self, global_step: int) -> frozenset[str]:
        """Corpora whose rows are dropped at ``global_step``: excluded, or gated at or before it."""
        gated = {
            event.corpus_id for event in self.events if event.kind == "gate" and event.step <= global_step
        }
        return self.excluded_corpora | gated

    def reverted(self, global_step: int) -> bool:
        """Whether a later rollback discarded what ``global_step`` trained."""
        return any(
            event.kind == "rollback"
            and event.to_step is not None
            and event.to_step <= global_step < event.step
            for event in self.events
        )

    def agrees_before(self, other: ScheduleSpec, step: int) -> bool:
        """Whether global steps ``0..step-1`` read the same rows under ``other`` and were kept or
        discarded alike (a ledger of them computed under one holds for the other): the same
        inputs but events, and the same gates taking effect before ``step`` and rollbacks reaching
        back before it (a later gate or rollback changes only later steps)."""

        def early(spec: ScheduleSpec) -> set[ScheduleEvent]:
            return {
                event
                for event in spec.events
                if (event.kind == "gate" and event.step < step)
                or (event.kind == "rollback" and event.to_step is not None and event.to_step < step)
            }

        same_inputs = (self.version, self.seed, self.world_size, self.batch_size, self.routes) == (
            other.version,
            other.seed,
            other.world_size,
            other.batch_size,
            other.routes,
        )
        return same_inputs and self.excluded_corpora == other.excluded_corpora and early(self) == early(other)

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON document (stable ordering); ``from_json`` reads it back."""
        return {
            "version": self.version,
            "seed": self.seed,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "routes": [
                {"route": route.route, "corpus_counts": [[c, n] for c, n in route.corpus_counts]}
                for route in self.routes
            ],
            "excluded_corpora": sorted(self.excluded_corpora),
            "events": [event.to_json() for event in self.events],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScheduleSpec:
        _check_version(data.get("version"))
        try:
            return cls(
                seed=int(data["seed"]),
                world_size=int(data["world_size"]),
                batch_size=int(data["batch_size"]),
                routes=tuple(
                    RouteLayout(str(r["route"]), tuple((str(c), int(n)) for c, n in r["corpus_counts"]))
                    for r in data["routes"]
                ),
                excluded_corpora=frozenset(str(c) for c in data["excluded_corpora"]),
                events=tuple(
                    ScheduleEvent(
                        step=int(e["step"]),
                        kind=e["kind"],
                        corpus_id=str(e["corpus_id"]),
                        to_step=None if e.get("to_step") is None else int(e["to_step"]),
                    )
                    for e in data["events"]
                ),
                version=int(data["version"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ScheduleError(f"malformed schedule spec: {error!r}") from None

    def digest(self) -> str:
        """sha256 of the spec's canonical JSON."""
        return sha256_hex(canonical_json(self.to_json()))
