"""Warm trial hosts: the processes 1-worker CPU search trials train in, kept from search to search.

A Tune trial's actor starts on a fresh Ray worker. Importing torch and govray's trial code, and
torch's Dynamo at the first optimizer step, cost ~2.5 CPU-seconds per actor on a 2-core machine,
paid by every concurrent trial slot of every search: Tune's ``reuse_actors`` keeps an actor only
within one search. So a 1-worker CPU trial trains in a *trial host*: a 0-CPU Ray actor on the
Tune trial's node, leased from this job's pool (``TrialHosts``, named ``govray-trial-hosts`` and
owned by the driver, so it and its hosts end with the driver's job).

- The Tune trial (``tune_trial`` here) holds the trial's CPUs and imports nothing but Ray Tune. It
  hands its sample, its Tune trial id and the checkpoint Tune restored to its host, and relays
  each validation the host sends to Tune, answering whether the trial goes on: the host's
  ``HostedSession`` returns or raises exactly where ``ray.tune.report`` would in a trial trained in
  the Tune actor, so a stopped trial ends at the same step boundary with the same sealed checkpoint.
- Nothing of an earlier trial reaches the next (each step is seeded from the run's seed and the
  step: the rule ``reuse_actors`` already relies on), and a host serves the trials of one code
  snapshot only (the reproducibility record's digests): changed code gets fresh hosts, like a new
  job gets fresh Ray workers.
- A host whose trial failed, or whose Tune trial died, is killed, never reused. A host idle for
  ``GOVRAY_TRIAL_HOST_IDLE_S`` seconds (default 300) exits, so a driver that stays up after its
  searches does not hold their memory.
- ``GOVRAY_TRIAL_HOSTS=0`` trains every trial in its Tune actor, as before hosts.

Example (what ``govray.platform.search`` does for a 1-worker CPU search)::

    trainable = ray.tune.with_parameters(tune_trial, setup=[ray.put(setup)], hosts=trial_hosts(), code=key)
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from govray.platform.placement_guard import actor_dead

POOL_NAME = "govray-trial-hosts"
REAP_PERIOD = 5.0  # seconds between the pool's looks for idle hosts and dead Tune trials
ABANDON_S = 60.0  # how long a host whose Tune trial died may take to end its trial


def hosts_enabled(max_workers: int, use_gpu: bool) -> bool:
    """Whether a search's trials train in trial hosts: 1-worker CPU trials, unless
    ``GOVRAY_TRIAL_HOSTS=0`` (a GPU trial's device is the Tune actor's; an N-worker trial's workers
    are Ray Train's)."""
    return max_workers == 1 and not use_gpu and os.environ.get("GOVRAY_TRIAL_HOSTS", "1") != "0"


Validation = tuple[dict[str, Any], str | None]  # a Tune result and its checkpoint folder


class _Channel:
    """One lease's two queues: the host's validations out, Tune's answers in."""

    def __init__(self) -> None:
        self.out: queue.Queue[Validation | None] = queue.Queue()
        self.answers: queue.Queue[bool] = queue.Queue()


class TrialHost:
    """One warm process that trains one trial at a time for the Tune trial that leased it (a
    threaded Ray actor: ``run`` trains while ``next`` and ``answer`` carry the validations). Each
    lease talks over its own channel, so nothing a dead lessee left unread reaches the next."""

    def __init__(self) -> None:
        self._channels: dict[str, _Channel] = {}
        self._lock = threading.Lock()
        self._abandoned = threading.Event()  # the lessee died: end the trial at the next step
        self._running = False
        self._trained = 0  # trials begun here
        self._torch_threads = 0  # the last trial's, as its own thread saw them

    def state(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "trained": self._trained,
            "running": self._running,
            "torch_threads": self._torch_threads,
        }

    def _channel(self, lease: str) -> _Channel:
        with self._lock:
            return self._channels.setdefault(lease, _Channel())

    def run(
        self,
        lease: str,
        params: dict[str, Any],
        setup: Any,
        tune_trial_id: str,
        resume: str | None,
        threads: str | None,
    ) -> None:
        """Train the trial (``govray.platform.search_trial.train_trial``) with a ``HostedSession``;
        ``next`` gives None once it has ended, however it ended. ``threads``: the Tune trial's
        ``OMP_NUM_THREADS`` (Ray sets it from the CPUs the Tune trial holds; this 0-CPU actor's
        own says 1), which decides the trial's torch threads as it would in the Tune trial."""
        from govray.platform.search_trial import train_trial
        from govray.train.session import HostedSession

        with self._lock:  # what an earlier lease left is dropped
            self._channels = {lease: self._channels.get(lease, _Channel())}
        channel = self._channel(lease)
        self._abandoned.clear()
        self._running = True
        self._trained += 1

        def relay(result: dict[str, Any], folder: str | None) -> bool:
            channel.out.put((result, folder))
            while not self._abandoned.is_set():
                with contextlib.suppress(queue.Empty):
                    return channel.answers.get(timeout=0.5)
            return False

        def session(spec: Any, worker: Any) -> HostedSession:
            return HostedSession(spec, worker, relay, self._abandoned.is_set)

        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
        try:
            train_trial(params, setup, tune_trial_id, resume, session)
        except SystemExit:
            pass  # the Tune trial was stopped at this validation: the trial ended there
        finally:
            if (torch := sys.modules.get("torch")) is not None:  # OpenMP's count is per thread
                self._torch_threads = torch.get_num_threads()
            self._running = False
            channel.out.put(None)

    def next(self, lease: str) -> Validation | None:
        """The next validation's Tune result and checkpoint folder; None once the trial ended."""
        return self._channel(lease).out.get()

    def answer(self, lease: str, go_on: bool) -> None:
        """Tune's answer to the last validation: go on, or end the trial there."""
        self._channel(lease).answers.put(go_on)

    def abandon(self) -> None:
        """The lessee is dead: the trial ends at its next step boundary (or validation)."""
        self._abandoned.set()


@dataclass
class _Held:
    host: Any
    node: str
    code: str
    lessee: str | None  # the leasing Tune trial's actor id; None while free
    since: float  # time.monotonic() of its last release, or of its abandonment while leased
    abandoned: bool = False


class TrialHosts:
    """The job's trial hosts (a 0-CPU Ray actor owned by the driver; the hosts are its own)."""

    def __init__(self, idle_s: float) -> None:
        self._idle_s = idle_s
        self._held: dict[int, _Held] = {}
        self._made = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._reap, name="govray-trial-host-reaper", daemon=True).start()

    def lease(self, node: str, code: str, lessee: str) -> tuple[int, Any]:
        """A free live host on ``node`` for ``code`` (a new one when none is free), leased to the
        Tune trial ``lessee``. Free hosts of other code on the node are retired."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self._lock:
            for number, held in list(self._held.items()):
                if held.lessee is None and held.node == node and held.code == code:
                    if actor_dead(held.host._actor_id.hex()):  # Ray's OOM killer, a crash
                        self._held.pop(number)
                        continue
                    held.lessee = lessee
                    return number, held.host
            for number, held in list(self._held.items()):
                if held.lessee is None and held.node == node:
                    self._retire(number)
            host = (
                ray.remote(TrialHost)
                .options(
                    num_cpus=0,  # the Tune trial holds the trial's CPUs
                    max_concurrency=4,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                )
                .remote()
            )
            self._made += 1
            self._held[self._made] = _Held(host, node, code, lessee, time.monotonic())
            return self._made, host

    def release(self, number: int, reusable: bool) -> None:
        """The lease of host ``number`` ended; a host that cannot be trusted again is killed."""
        with self._lock:
            held = self._held.get(number)
            if held is None:
                return
            if reusable:
                held.lessee, held.since, held.abandoned = None, time.monotonic(), False
            else:
                self._retire(number)

    def hosts(self) -> list[dict[str, Any]]:
        """Every live host: its number, node, code digest, whether it is leased, and its
        ``TrialHost.state``."""
        with self._lock:
            held = dict(self._held)
        listed = []
        for number, host in held.items():
            try:
                state = ray.get(host.host.state.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue  # retired meanwhile, or dying
            listed.append(
                {
                    "number": number,
                    "node": host.node,
                    "code": host.code,
                    "leased": host.lessee is not None,
                    **state,
                }
            )
        return listed

    def _retire(self, number: int) -> None:
        held = self._held.pop(number)
        ray.kill(held.host)

    def _reap(self) -> None:
        while True:
            time.sleep(REAP_PERIOD)
            try:
                self._reap_once()
            except Exception:  # a GCS hiccup must not end the reaper
                logging.getLogger(__name__).exception("trial host reaper")

    def _reap_once(self) -> None:
        """Idle hosts exit. A host whose lessee died is asked to end its trial, then freed once
        the trial has ended (killed if it has not within ``ABANDON_S``)."""
        with self._lock:
            leased = {n: h.lessee for n, h in self._held.items() if h.lessee is not None}
        dead = {n for n, lessee in leased.items() if lessee is not None and actor_dead(lessee)}
        now = time.monotonic()
        with self._lock:
            for number, held in list(self._held.items()):
                if held.lessee is None and now - held.since > self._idle_s:
                    self._retire(number)
                elif number in dead and held.lessee == leased[number] and not held.abandoned:
                    held.abandoned, held.since = True, now
                    held.host.abandon.remote()
            abandoned = {n: h for n, h in self._held.items() if h.abandoned}
        for number, held in abandoned.items():
            try:
                running = ray.get(held.host.state.remote(), timeout=30)["running"]
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                running = None  # dead or stuck
            with self._lock:
                if self._held.get(number) is not held:
                    continue
                if running is False:
                    held.lessee, held.since, held.abandoned = None, time.monotonic(), False
                elif running is None or time.monotonic() - held.since > ABANDON_S:
                    self._retire(number)


def trial_hosts() -> Any:
    """This job's pool of trial hosts (made by the first search that needs it; its hosts exit
    after ``GOVRAY_TRIAL_HOST_IDLE_S`` idle seconds, default 300)."""
    idle_s = float(os.environ.get("GOVRAY_TRIAL_HOST_IDLE_S", "300"))
    return (
        ray.remote(TrialHosts)
        .options(name=POOL_NAME, get_if_exists=True, num_cpus=0, max_concurrency=8)
        .remote(idle_s)
    )


def retire_trial_hosts() -> None:
    """End this job's pool and its hosts (the next search starts fresh ones)."""
    with contextlib.suppress(ValueError):  # there is none
        ray.kill(ray.get_actor(POOL_NAME))


def tune_trial(params: dict[str, Any], setup: list[Any], hosts: Any, code: str) -> None:
    """The Tune function trainable of a hosted trial (named like
    ``govray.platform.search_trial.tune_trial``: Tune restores a search by its trainable's name).
    ``setup``: the ``SearchSetup``'s object ref in a list (this process never opens it, so never
    imports what it holds), ``hosts``: the pool, ``code``: the code snapshot's digest."""
    import ray.tune
    from ray.exceptions import RayTaskError
    from ray.train import Checkpoint

    here = ray.get_runtime_context()
    tune_trial_id = ray.tune.get_context().get_trial_id()
    lease = f"{here.get_actor_id()}-{tune_trial_id}-{time.monotonic_ns()}"
    restored = ray.tune.get_checkpoint()
    with restored.as_directory() if restored is not None else contextlib.nullcontext(None) as resume:
        number, host = ray.get(hosts.lease.remote(here.get_node_id(), code, here.get_actor_id()))
        reusable = False
        try:
            threads = os.environ.get("OMP_NUM_THREADS")
            run = host.run.remote(lease, params, setup[0], tune_trial_id, resume, threads)
            while (validation := ray.get(host.next.remote(lease))) is not None:
                result, folder = validation
                try:
                    ray.tune.report(result, checkpoint=Checkpoint.from_directory(folder) if folder else None)
                except BaseException:  # Tune stopped the trial (SystemExit), or this actor is ending
                    ray.get(host.answer.remote(lease, False))
                    ray.get(host.next.remote(lease))  # the trial ended at this step boundary
                    ray.get(run)
                    reusable = True
                    raise
                ray.get(host.answer.remote(lease, True))
            try:
                ray.get(run)
            except RayTaskError as error:  # the trial's own error, with the host's traceback
                raise error.as_instanceof_cause() from None
            reusable = True
        finally:
            # Awaited, so this actor's next trial finds the host free (if this process is ending
            # meanwhile, the pool's reaper frees the host instead).
            with contextlib.suppress(Exception):
                ray.get(hosts.release.remote(number, reusable), timeout=30)
