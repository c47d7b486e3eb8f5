"""The placement groups of a search's Ray Train runs, freed when their trial stops running.

A search trial's workers live in a placement group that Ray Train's controller creates unnamed and
removes only when its run ends gracefully. When Tune stops a trial (ASHA's stop, PBT's pause, an
error) it drops the trial's actor without waiting for the run: the group outlives the trial until
the driver exits (Ray issue 54305; Ray 2.60's ``PlacementGroupCleaner`` narrows but does not close
it, issue 62753), holding the CPUs the next trial needs. So each trial's Tune results name its
workers' group (``PLACES_KEY``), and the driver removes every group of a trial that is no longer
running, and every earlier group of one that runs again (a restored actor's run has a new one).

Example::

    guard = PlacementGuard()
    guard.note("t1", result)            # each Tune result of trial t1
    guard.release("t1")                 # t1 stopped: its groups removed (those Ray left)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

PLACES_KEY = "govray_workers"  # a Tune result's workers, {rank: {"pid", "placement_group"}} as JSON
REMOVED = "REMOVED"  # a group's state in ``ray.util.placement_group_table()`` once removed


def result_places(result: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """The workers a Tune result names, by rank (none in a 1-worker trial's results)."""
    return {int(rank): place for rank, place in json.loads(result.get(PLACES_KEY, "{}")).items()}


class PlacementGuard:
    """On the driver: each trial's placement groups, removed when it stops running."""

    def __init__(self) -> None:
        self.current: dict[str, set[str]] = {}  # trial id → groups of its latest run
        self.earlier: dict[str, set[str]] = {}  # trial id → groups of its earlier runs, not yet freed
        self.removed: list[str] = []  # every group this guard removed (Ray had not)

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

    def sweep(self, running: Iterable[str]) -> None:
        """Remove the groups of every trial not in ``running``, and the earlier runs' groups of
        those that are (cheap when there is nothing to remove: no call to Ray)."""
        running = set(running)
        for trial_id in [t for t in self.current if t not in running]:
            self.release(trial_id)
        stale = set().union(*self.earlier.values()) if self.earlier else set()
        self.earlier.clear()
        self._remove(stale)

    def release_all(self) -> None:
        self.sweep(())

    def _remove(self, groups: set[str]) -> None:
        if not groups:
            return
        import ray
        from ray.util.placement_group import PlacementGroup

        table = ray.util.placement_group_table()
        for group in sorted(groups):
            if group in table and table[group]["state"] != REMOVED:
                ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group)))
                self.removed.append(group)
