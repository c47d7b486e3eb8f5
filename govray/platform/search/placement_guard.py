"""The placement groups of a search's Ray Train runs, freed when their trial stops running.

A search trial's workers live in a placement group that Ray Train's controller creates unnamed and
removes only when its run ends gracefully. When Tune stops a trial (ASHA's stop, PBT's pause, an
error) it drops the trial's actor without waiting for the run: the group outlives the trial until
the driver exits (Ray issue 54305; Ray 2.60's ``PlacementGroupCleaner`` narrows but does not close
it, issue 62753), holding the CPUs the next trial needs. So each trial's Tune results name its
workers' group (``PLACES_KEY``), and the driver removes every group of a trial that is no longer
running, and every earlier group of one that runs again (a restored actor's run has a new one).

A group no result named yet (the trial stopped while its run was starting, or between a worker
group's restart and its first report) is an *orphan*: its creator, the run's Train controller, died
with the trial, yet Ray keeps a group until its creator's job ends. ``orphaned_groups`` finds this
job's orphans in the GCS's own tables: the group's record says whether its creator died, except
when the creator died while the group was being created (seen in CI: the record says alive, the
actor table DEAD, and Ray never frees it), so a creator the actor table calls dead counts as dead.
The guard removes orphans when a trial stops, every ``ORPHAN_CHECK_S`` while the search runs (a
controller may die after Tune reported its trial stopped, and the trials still waiting for its
CPUs would wait forever), and, waiting for the last controllers to die, when the search ends. A
controller that outlives the search (seen in CI: one between two worker groups, holding no group
yet, created one after the search had returned and the test's next run waited for its CPUs forever)
is killed once ``SETTLE_S`` have passed: the search is over, nothing will ever report to it.

Example::

    guard = PlacementGuard()
    guard.note("t1", result)            # each Tune result of trial t1
    guard.release("t1")                 # t1 stopped: its groups removed (those Ray left)
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

PLACES_KEY = "govray_workers"  # a Tune result's workers, {rank: {"pid", "placement_group"}} as JSON
REMOVED = "REMOVED"  # a group's state in ``ray.util.placement_group_table()`` once removed
CONTROLLER = "TrainController"  # the class of Ray Train's controller actor (one per run)


def result_places(result: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """The workers a Tune result names, by rank (none in a 1-worker trial's results)."""
    return {int(rank): place for rank, place in json.loads(result.get(PLACES_KEY, "{}")).items()}


@dataclass(frozen=True)
class JobGroup:
    """One placement group this job created that Ray still holds, from the GCS's table."""

    group: str  # its id, in hex
    by_actor: bool  # an actor created it (a Train controller), not the driver (Tune's trials' groups)
    creator_dead: bool  # that actor is dead (Ray says so of a driver's group too: never an orphan)

    @property
    def orphaned(self) -> bool:
        return self.by_actor and self.creator_dead

    @property
    def creator_alive(self) -> bool:
        return self.by_actor and not self.creator_dead


def held_groups() -> list[JobGroup]:
    """This job's placement groups not yet removed, with whether their creator is alive. Read from
    the GCS's own records (``ray.util.placement_group_table`` leaves out the creator); Ray's state
    API would need the dashboard, which a small node runs without."""
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    table_data: Any = gcs_pb2.PlacementGroupTableData  # type: ignore[attr-defined]  # generated, unstubbed
    job = ray.get_runtime_context().get_job_id()
    nil = ray.ActorID.nil().binary()  # the creator of a group the driver made (Tune's trials' groups)
    held = []
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        data = table_data.FromString(raw)
        if data.creator_job_id.hex() == job and data.state != table_data.REMOVED:
            by_actor = data.creator_actor_id != nil
            dead = data.creator_actor_dead or (by_actor and actor_dead(data.creator_actor_id.hex()))
            held.append(JobGroup(data.placement_group_id.hex(), by_actor, dead))
    return held


def actor_dead(actor: str) -> bool:
    """The actor table calls ``actor`` dead, or no longer knows it (the GCS forgets dead actors)."""
    from ray._private.state import state

    return state.actor_table(actor).get("State", "DEAD") == "DEAD"


def live_controllers() -> set[str]:
    """The Ray Train controllers of this job that are not dead, by actor id (hex)."""
    import ray
    from ray._private.state import state

    job = ray.get_runtime_context().get_job_id()
    return {
        actor
        for actor, info in state.actor_table(None).items()
        if info["JobID"] == job and info["ActorClassName"] == CONTROLLER and info["State"] != "DEAD"
    }


def kill_actor(actor: str) -> None:
    """Kills the actor with id ``actor`` (hex) for good, without its handle (``ray.kill`` needs one,
    and a controller's handle lives in the thread of the trial that started its run)."""
    import ray

    core_worker: Any = ray._private.worker.global_worker.core_worker  # type: ignore[attr-defined]  # private
    core_worker.kill_actor(ray.ActorID.from_hex(actor), True)


def orphaned_groups() -> list[str]:
    """This job's groups whose creator died: nobody will ever use or remove them but Ray at the
    job's end, and they hold their CPUs until then."""
    return sorted(held.group for held in held_groups() if held.orphaned)


def remove_group(group: str) -> None:
    import ray
    from ray.util.placement_group import PlacementGroup

    ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group)))


class PlacementGuard:
    """On the driver: each trial's placement groups, removed when it stops running."""

    SETTLE_S = 30.0  # at the search's end, how long its runs' controllers get to die
    KILLED_S = 10.0  # and how long those killed then get
    ORPHAN_CHECK_S = 5.0  # while the search runs, how often orphans are looked for

    def __init__(self) -> None:
        self.before: set[str] | None = None  # this job's groups when the search began
        self.controllers: set[str] = set()  # this job's live Train controllers when the search began
        self.current: dict[str, set[str]] = {}  # trial id → groups of its latest run
        self.earlier: dict[str, set[str]] = {}  # trial id → groups of its earlier runs, not yet freed
        self.removed: list[str] = []  # every group this guard removed (Ray had not)
        self.checked = 0.0  # when orphans were last looked for (time.monotonic)

    def begin(self) -> None:
        """The search begins: the groups this job holds now are not the search's."""
        import ray

        if ray.is_initialized():
            self.before = {held.group for held in held_groups()}
            self.controllers = live_controllers()
        else:
            self.before = set()

    def note(self, trial_id: str, result: Mapping[str, Any]) -> None:
        groups = {place["placement_group"] for place in result_places(result).values()} - {""}
        if not groups or groups == self.current.get(trial_id):
            return
        stale = self.current.get(trial_id, set()) - groups
        self.earlier.setdefault(trial_id, set()).update(stale)
        self.current[trial_id] = groups

    def release(self, trial_id: str) -> None:
        """The trial stopped running: remove every group of its runs that Ray has not."""
        groups = self.current.pop(trial_id, set()) | self.earlier.pop(trial_id, set())
        self._remove(groups)
        if self.before is not None:
            self._remove_orphans()

    def sweep(self, running: Iterable[str]) -> None:
        """Remove the groups of every trial not in ``running``, the earlier runs' groups of those
        that are, and, at most every ``ORPHAN_CHECK_S``, the search's orphans (otherwise cheap when
        there is nothing to remove: no call to Ray)."""
        running = set(running)
        for trial_id in [t for t in self.current if t not in running]:
            self.release(trial_id)
        stale = set().union(*self.earlier.values()) if self.earlier else set()
        self.earlier.clear()
        self._remove(stale)
        if self.before is not None and time.monotonic() - self.checked >= self.ORPHAN_CHECK_S:
            self._remove_orphans()

    def release_all(self) -> None:
        """The search is over: every trial's groups go, and every group a run of the search
        created, once its controller died. The controllers Tune's last stops are tearing down get
        ``SETTLE_S`` to die; those still alive then are killed (and their groups removed)."""
        self.sweep(())
        if self.before is None:
            return
        if self._settled(self.SETTLE_S):
            return
        lingering = sorted(live_controllers() - self.controllers)
        logger.warning("Train controllers %s outlived the search: killed", lingering)
        for actor in lingering:
            kill_actor(actor)
        if not self._settled(self.KILLED_S):  # a kill is asynchronous
            logger.warning("placement groups of the search outlived its killed controllers")

    def _settled(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s until no run of the search lives; whether none does."""
        deadline = time.monotonic() + timeout
        while self._lingering():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)
        return True

    def _lingering(self) -> bool:
        """A run of the search still lives: a controller started since ``begin``, or a group
        whose creator is alive (the orphans of dead ones are removed on the way)."""
        assert self.before is not None
        self._remove_orphans()
        if live_controllers() - self.controllers:
            return True
        return any(held.creator_alive and held.group not in self.before for held in held_groups())

    def _remove_orphans(self) -> None:
        assert self.before is not None
        self.checked = time.monotonic()
        for group in orphaned_groups():
            if group not in self.before:
                remove_group(group)
                self.removed.append(group)

    def _remove(self, groups: set[str]) -> None:
        if not groups:
            return
        import ray

        table = ray.util.placement_group_table()
        for group in sorted(groups):
            if group in table and table[group]["state"] != REMOVED:
                remove_group(group)
                self.removed.append(group)
