"""A persistent group of spawned processes for tests of collectives: each runs ``target(rank,
init_file, tasks, results)`` (which joins a gloo process group through ``init_file`` and answers
each task on ``results`` as ``(rank, status, payload)`` until it receives None); ``run(task)``
sends one task to every rank and gathers their answers."""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

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
    for process in processes:
        process.start()

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
