"""A persistent group of spawned processes for tests of collectives: each runs ``target(rank,
init_file, tasks, results)`` (which joins a gloo process group through ``init_file`` and answers
each task on ``results`` as ``(rank, status, payload)`` until it receives None); ``run(task)``
sends one task to every rank and gathers their answers. ``rank_main`` is such a target: each task a
function and its arguments."""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.builders import REPO

Run = Callable[[Any], dict[int, tuple[str, Any]]]


@contextmanager
def persistent_group(
    target: Callable[..., None], directory: Path, world: int, timeout: float
) -> Iterator[Run]:
    context = mp.get_context("spawn")
    init_file = str(directory / "init")
    tasks = [context.Queue() for _ in range(world)]
    results = context.Queue()
    processes = [
        context.Process(target=target, args=(rank, init_file, tasks[rank], results), daemon=True)
        for rank in range(world)
    ]
    # A spawned rank starts with this process's sys.path. An in-process replay earlier in the
    # session put its run's code snapshot first there (govray.train.trial: the snapshot wins), and
    # a snapshot holds only its trial's package: the ranks import from the repository instead.
    kept = list(sys.path)
    sys.path[:] = [str(REPO), *(entry for entry in kept if not _snapshot(entry))]
    try:
        for process in processes:
            process.start()
    finally:
        sys.path[:] = kept

    def run(task: Any) -> dict[int, tuple[str, Any]]:
        for inbox in tasks:
            inbox.put(task)
        answers = {}
        for _ in range(world):
            try:
                rank, status, payload = results.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"a gloo rank did not answer within {timeout:g} s")
            answers[rank] = (status, payload)
        return answers

    try:
        yield run
    finally:
        for inbox in tasks:
            inbox.put(None)
        for process in processes:
            process.join(timeout=10)


def _snapshot(entry: str) -> bool:
    """Whether a ``sys.path`` entry is a run's code snapshot (a folder holding a ``jobs`` package
    that is not the repository's)."""
    path = Path(entry)
    return path != REPO and (path / "jobs").is_dir() and not path.is_relative_to(REPO)


def rank_main(rank: int, init_file: str, tasks: Any, results: Any, world: int) -> None:
    """A rank that runs each task ``(function, *args)`` as ``function(rank, world, *args)``, answering
    what it returns (``(status, payload)``), or ``("crash", traceback)``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    while (task := tasks.get()) is not None:
        try:
            results.put((rank, *task[0](rank, world, *task[1:])))
        except Exception:
            results.put((rank, "crash", traceback.format_exc()))
    dist.destroy_process_group()
