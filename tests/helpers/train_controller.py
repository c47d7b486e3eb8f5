"""An actor class named as Ray Train's controller is (a module's top-level ``TrainController``),
which creates a placement group as that controller does: what the search's placement guard finds
by name. Importable by Ray's workers, unlike a test module."""

from __future__ import annotations

from typing import Any


class TrainController:
    def create(self) -> str:
        """Creates a group and waits until it is placed; its id, in hex."""
        import ray
        from ray.util.placement_group import placement_group

        group = placement_group([{"CPU": 0.5}])
        ray.get(group.ready())
        return str(group.id.hex())

    def ready(self) -> None:
        """Between two worker groups: alive, holding no group."""


def train_controller() -> Any:
    """A live ``TrainController`` actor of this job, using no CPU."""
    import ray

    return ray.remote(num_cpus=0)(TrainController).remote()  # type: ignore[attr-defined]
