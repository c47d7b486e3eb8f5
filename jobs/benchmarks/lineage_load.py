"""Lineage queries under load: the Ray Serve lineage app on 127.0.0.1 over a store of ≥ 1,000,000
ledger rows, 4 concurrent keep-alive HTTP clients, against the same load on its empty endpoint.

The store (``jobs/benchmarks/lineage_store.py``): one real governed digits run, registered, plus
bulk-inserted synthetic search experiments (by default 32 experiments of 10 trials of 5
checkpoints: 1,011,200 ledger rows, 32 registered versions). The mix: lineage of a model version
(whole, or filtered by one of a few layers) or of a trial's last checkpoint, influence of a
corpus, and row lookups (recomputed from the real run's schedule), weighted 50/30/20 by default.

First every distinct question is asked once, one at a time (``cold``: answered by the database;
the app then keeps the answer until the store changes). Then ``rounds`` rounds alternate
``duration`` seconds of the mix and of ``GET /api/ping`` with ``clients`` threads, each with its own
``requests.Session``. Any answer but 200 fails the run.

With ``--writes-per-second N`` a writer process commits, N times a second during each mix phase
(the empty endpoint's phases run without it: the stricter comparison), a report and a checkpoint
with its ledger rows of a running trial that no question reads (what a live training run's driver
does to the store): the app's cache must keep the answers that did not change.

Run: ``python -m jobs.benchmarks.lineage_load`` (``--quick`` for a small store and short phases;
``--workdir DIR`` keeps the store and reuses it on the next run). The last two lines are::

    lineage p50 X.X ms, p99 X.X ms, Y rps
    lineage/empty-endpoint throughput ratio: X.XXX
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

from govray.tracking.lineage import record_checkpoint, record_ledger
from govray.tracking.store import TrackingStore
from govray.tracking.tables import TrialState
from jobs.benchmarks.lineage_store import Workload, add_synthetic, real_run

KINDS = ("lineage", "influence", "rows")


@dataclass
class Sample:
    """Latencies (ms) of successful answers, by kind, and the failures seen."""

    latencies: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, other: Sample) -> None:
        for kind, values in other.latencies.items():
            self.latencies.setdefault(kind, []).extend(values)
        self.failures += other.failures
        self.seconds += other.seconds

    def all(self) -> list[float]:
        return [value for values in self.latencies.values() for value in values]

    def rps(self) -> float:
        return len(self.all()) / self.seconds if self.seconds else 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def describe(values: list[float]) -> str:
    return (
        f"n={len(values)} p50 {percentile(values, 50):.1f} ms, p90 {percentile(values, 90):.1f} ms, "
        f"p99 {percentile(values, 99):.1f} ms, max {max(values, default=float('nan')):.1f} ms"
    )


def build_store(workdir: Path, args: argparse.Namespace) -> tuple[str, Workload]:
    """The store in ``workdir`` (reused when it was built before), and what to ask it."""
    saved = workdir / "workload.json"
    if saved.is_file():
        raw = json.loads(saved.read_text())
        TrackingStore.open(raw["url"]).close()  # migrated to this govray's schema
        print(f"reusing the store in {workdir} ({raw['workload']['ledger_rows']:,} ledger rows)", flush=True)
        return str(raw["url"]), Workload(**raw["workload"])
    started = time.perf_counter()
    url, workload = real_run(workdir / "real", args.real_steps)
    print(f"real governed run: {workload.ledger_rows} ledger rows in {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    workload.extend(add_synthetic(url, args.experiments, args.trials, args.checkpoints))
    print(f"synthetic experiments inserted in {time.perf_counter() - started:.0f} s", flush=True)
    saved.write_text(json.dumps({"url": url, "workload": asdict(workload)}))
    return url, workload


def start_app(url: str) -> str:
    """The lineage app under Ray Serve on a free 127.0.0.1 port; returns its base URL."""
    from govray.config.serve import ServeSettings
    from serve.app import start

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    base = start(ServeSettings(database_url=url, host="127.0.0.1", port=port))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base}/api/ping", timeout=10).status_code == 200:
                return base
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the lineage app did not answer on {base}")


def cold_pass(base: str, workload: Workload) -> Sample:
    """Every distinct question once, one at a time: the database's own latency."""
    sample = Sample()
    started = time.perf_counter()
    with requests.Session() as session:
        for kind in KINDS:
            for path in getattr(workload, kind):
                ask(session, base, kind, path, sample)
    sample.seconds = time.perf_counter() - started
    return sample


def ask(session: requests.Session, base: str, kind: str, path: str, sample: Sample) -> None:
    began = time.perf_counter()
    answer = session.get(base + path, timeout=60)
    elapsed = (time.perf_counter() - began) * 1e3
    if answer.status_code != 200 or not answer.content:
        sample.failures.append(f"{path}: {answer.status_code} {answer.text[:200]}")
    else:
        sample.latencies.setdefault(kind, []).append(elapsed)


def load(
    base: str, questions: dict[str, list[str]], weights: dict[str, float], clients: int, seconds: float
) -> Sample:
    """``clients`` threads asking ``questions`` (kind → paths, kinds drawn by ``weights``) for
    ``seconds`` seconds."""
    kinds = [kind for kind in questions if questions[kind]]
    shares = [weights[kind] for kind in kinds]
    results = [Sample() for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def client(index: int) -> None:
        draw = random.Random(index)
        with requests.Session() as session:
            session.get(base + "/api/ping", timeout=60)  # open the keep-alive connection first
            start.wait()
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                kind = draw.choices(kinds, shares)[0]
                ask(session, base, kind, draw.choice(questions[kind]), results[index])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    total = Sample()
    for result in results:
        total.add(result)
    total.seconds = time.perf_counter() - began  # the phase's wall time, not the clients' sum
    return total


WRITER_CORPORA = ("writer-news", "writer-forum")  # the writer's own: no question of the mix names them
WRITER_TENSORS = 24


@contextmanager
def writing(url: str, per_second: float) -> Iterator[None]:
    """While the block runs, a running trial of its own experiment commits ``per_second`` times a
    second (0: none) one report (metrics and progress) and one checkpoint with its ledger rows, as
    the driver records a training run: each a new store generation, none of them read by the mix.
    The writer is a process of its own, as a training run's driver is (a thread here would take
    the GIL from the load's clients)."""
    if per_second <= 0:
        yield
        return
    store = TrackingStore(url)
    experiment = store.create_experiment("lineage-load-writer", "{}", "0" * 64, "/nonexistent/writer")
    trial = store.create_trial(experiment.id or 0, "{}", seed=1)
    trial_id = trial.id or 0
    store.set_trial_state(trial_id, TrialState.ACTIVE)
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    writer = context.Process(target=write, args=(url, trial_id, per_second, stop), daemon=True)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join(timeout=60)
        store.set_trial_state(trial_id, TrialState.COMPLETED)
        store.close()
    if writer.exitcode != 0:
        raise SystemExit(f"the writer failed (exit code {writer.exitcode})")


def write(url: str, trial_id: int, per_second: float, stop: Any) -> None:
    """The writer process: a report and a checkpoint with its ledger rows every 1/``per_second`` s."""
    store, step = TrackingStore(url), 0
    try:
        while not stop.wait(1 / per_second):
            step += 1
            store.record_report(trial_id, step, {"training": {"training_loss": 1 / step}})
            checkpoint = record_checkpoint(
                store, trial_id, f"/nonexistent/writer/checkpoint_{step:06d}", step
            )
            rows = [
                (corpus, f"layer{tensor}.weight", tensor, 8 * step, 0, step)
                for corpus in WRITER_CORPORA
                for tensor in range(WRITER_TENSORS)
            ]
            record_ledger(store, trial_id, rows, checkpoint_id=checkpoint.id)
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="keep the store here and reuse it next time")
    parser.add_argument("--experiments", type=int, default=32)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--checkpoints", type=int, default=5)
    parser.add_argument("--real-steps", type=int, default=20)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mix", default="lineage=0.5,influence=0.3,rows=0.2")
    parser.add_argument(
        "--writes-per-second",
        type=float,
        default=0.0,
        help="a running trial's reports and checkpoints (with ledgers) committed per second during the mix",
    )
    parser.add_argument("--quick", action="store_true", help="4 experiments, one 5 s round (development)")
    args = parser.parse_args()
    if args.quick:
        args.experiments, args.duration, args.rounds = 4, 5.0, 1
    weights = {kind: float(share) for kind, share in (item.split("=") for item in args.mix.split(","))}
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="govray-lineage-load-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        run(workdir, weights, args)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def run(workdir: Path, weights: dict[str, float], args: argparse.Namespace) -> None:
    import ray
    from ray import serve

    # RAY_ADDRESS's cluster, else a Ray of this run's own (never one some other `ray start` left)
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False, log_to_driver=False)
    url, workload = build_store(workdir, args)
    questions = {kind: getattr(workload, kind) for kind in KINDS}
    print(
        f"store: {workload.ledger_rows:,} ledger rows; distinct questions: "
        + ", ".join(f"{kind} {len(paths)}" for kind, paths in questions.items()),
        flush=True,
    )
    base = start_app(url)
    try:
        cold = cold_pass(base, workload)
        for kind in KINDS:
            print(f"cold {kind}: {describe(cold.latencies.get(kind, []))}")
        mix, empty = Sample(), Sample()
        for round_ in range(args.rounds):
            phases = [("mix", questions), ("empty", {"ping": ["/api/ping"]})]
            for name, asked in phases if round_ % 2 == 0 else phases[::-1]:
                # the writer during the mix only: the empty endpoint's load has the machine to itself
                with writing(url, args.writes_per_second if name == "mix" else 0.0):
                    sample = load(base, asked, {**weights, "ping": 1.0}, args.clients, args.duration)
                (mix if name == "mix" else empty).add(sample)
                print(
                    f"round {round_ + 1} {name}: {sample.rps():.1f} rps, {describe(sample.all())}", flush=True
                )
    finally:
        serve.shutdown()
    failures = cold.failures + mix.failures + empty.failures
    for kind in KINDS:
        print(f"warm {kind}: {describe(mix.latencies.get(kind, []))}")
    print(f"empty endpoint: {empty.rps():.1f} rps, {describe(empty.all())}")
    ratio = mix.rps() / empty.rps()
    p99, empty_p99 = percentile(mix.all(), 99), percentile(empty.all(), 99)
    print(f"target throughput ratio >= 0.8: {'met' if ratio >= 0.8 else 'NOT met'} ({ratio:.3f})")
    print(
        f"target p99 <= 2 x empty p99: {'met' if p99 <= 2 * empty_p99 else 'NOT met'} "
        f"({p99:.1f} ms vs 2 x {empty_p99:.1f} ms)"
    )
    if failures:
        print(f"{len(failures)} requests failed, e.g.: " + "; ".join(failures[:3]))
        raise SystemExit(1)
    print(f"lineage p50 {percentile(mix.all(), 50):.1f} ms, p99 {p99:.1f} ms, {mix.rps():.1f} rps")
    print(f"lineage/empty-endpoint throughput ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
