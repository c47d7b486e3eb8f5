"""Warm trial hosts: the processes 1-worker CPU search trials train in, kept from search to search.

A Tune trial's actor starts on a fresh Ray worker. Importing torch and govray's trial code, and
torch's Dynamo at the first optimizer step, cost ~2.5 CPU-seconds per actor on a 2-core machine,
paid by every concurrent trial slot of every search: Tune's ``reuse_actors`` keeps an actor only
within one search. So a 1-worker CPU trial trains in a *trial host*: a 0-CPU Ray actor on the
Tune trial's node, leased from this job's pool (``TrialHosts``, named ``govray-trial-hosts`` and
owned by the driver, so it and its hosts end with the driver's job).

- The Tune trial (``hosted_trial``) holds the trial's CPUs and imports nothing but Ray Tune. It
  hands its sample, its Tune trial id and the checkpoint Tune restored to its host, and relays
  each validation the host sends to Tune, answering whether the trial goes on: the host's
  ``HostedSession`` returns or raises exactly where ``ray.tune.report`` would in a trial trained in
  the Tune actor, so a stopped trial ends at the same step boundary with the same sealed checkpoint.
- Nothing of an earlier trial reaches the next (each step is seeded from the run's seed and the
  step: the rule ``reuse_actors`` already relies on), and a host serves the trials of one code
  snapshot only (the reproducibility record's digests): changed code gets fresh hosts, like a new
  job gets fresh Ray workers.
- A host whose trial ended cleanly gives itself back to the pool (its Tune actor may be ended with
  the search before it could). A host whose trial failed is killed, never reused. A host whose
  Tune trial died is told to end that trial at its next step boundary (or never start it) and is
  then free again; it is killed if the trial has not ended within ``ABANDON_S``. A host idle for
  ``trial_hosts.idle_s`` seconds (``govray.core.settings``; ``GOVRAY_TRIAL_HOST_IDLE_S``, default
  300) exits, so a driver that stays up after its searches does not hold their memory.
- ``trial_hosts.enabled: false`` (``GOVRAY_TRIAL_HOSTS=0``) trains every trial in its Tune actor.

Example (what ``govray.platform.search.driver`` does for a 1-worker CPU search)::

    trainable = ray.tune.with_parameters(hosted_trial, setup=[ray.put(setup)], hosts=trial_hosts(), code=key)
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from govray.core.settings import load_settings
from govray.platform.search.placement_guard import actor_dead

POOL_NAME = "govray-trial-hosts"
REAP_PERIOD = 5.0  # seconds between the pool's looks for idle hosts and dead Tune trials
ABANDON_S = 60.0  # how long a host whose Tune trial died may take to end its trial


def hosts_enabled(max_workers: int, use_gpu: bool) -> bool:
    """Whether a search's trials train in trial hosts: 1-worker CPU trials, unless the
    ``trial_hosts.enabled`` setting is off (``GOVRAY_TRIAL_HOSTS=0``; a GPU trial's device is the
    Tune actor's; an N-worker trial's workers are Ray Train's)."""
    return max_workers == 1 and not use_gpu and load_settings().trial_hosts.enabled


Validation = tuple[dict[str, Any], str | None]  # a Tune result and its checkpoint folder


class _Channel:
    """One lease's two queues (the host's validations out, Tune's answers in) and whether its
    lessee died."""

    def __init__(self) -> None:
        self.out: queue.Queue[Validation | None] = queue.Queue()
        self.answers: queue.Queue[bool] = queue.Queue()
        self.abandoned = threading.Event()


class TrialHost:
    """One warm process that trains one trial at a time for the Tune trial that leased it (a
    threaded Ray actor: ``run`` trains while ``next`` and ``answer`` carry the validations). Each
    lease talks over its own channel, so nothing a dead lessee left unread reaches the next, and
    a lease the pool abandoned never starts, however late its ``run`` arrives. A trial that ended
    cleanly gives the host back to ``pool`` itself, before its lessee hears of the end: a Tune
    actor that Tune ends with the search may never get to say so."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._channels: dict[str, _Channel] = {}
        self._abandoned: set[str] = set()  # leases whose lessee died
        self._lock = threading.Lock()
        self._running = False
        self._failed = False  # a trial here raised: the pool must not lend this host again
        self._trained = 0  # trials begun here
        self._torch_threads = 0  # the last trial's, as its own thread saw them

    def state(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "trained": self._trained,
            "running": self._running,
            "failed": self._failed,
            "torch_threads": self._torch_threads,
        }

    def _channel(self, lease: str) -> _Channel:
        with self._lock:
            channel = self._channels.setdefault(lease, _Channel())
            if lease in self._abandoned:
                channel.abandoned.set()
            return channel

    def run(
        self,
        lease: str,
        params: dict[str, Any],
        setup: Any,
        tune_trial_id: str,
        resume: str | None,
        threads: str | None,
    ) -> None:
        """Train the trial (``govray.platform.search.tune_trial.train_trial``) with a ``HostedSession``;
        ``next`` gives None once it has ended, however it ended. ``threads``: the Tune trial's
        ``OMP_NUM_THREADS`` (Ray sets it from the CPUs the Tune trial holds; this 0-CPU actor's
        own says 1), which decides the trial's torch threads as it would in the Tune trial."""
        channel = self._channel(lease)
        with self._lock:
            if lease in self._abandoned:
                channel.out.put(None)
                return
            self._running = True
            self._trained += 1
        failed = False
        try:
            from govray.platform.search.tune_trial import train_trial

            def train(session: Any) -> None:
                train_trial(params, setup, tune_trial_id, resume, session)

            self._train(channel, threads, train)
        except SystemExit:
            pass  # the Tune trial was stopped at this validation: the trial ended there
        except BaseException:
            failed = self._failed = True  # its lessee (or the reaper) ends the lease: the host goes
            raise
        finally:
            self._running = False
            if not failed:
                with contextlib.suppress(Exception):  # else the reaper frees it
                    ray.get(self._pool.release.remote(lease, True), timeout=30)
            channel.out.put(None)

    def _train(self, channel: _Channel, threads: str | None, train: Callable[[Any], None]) -> None:
        """``train`` with a ``HostedSession`` on ``channel``, under the Tune trial's threads."""
        from govray.train.run.session import HostedSession

        def relay(result: dict[str, Any], folder: str | None) -> bool:
            channel.out.put((result, folder))
            while not channel.abandoned.is_set():
                with contextlib.suppress(queue.Empty):
                    return channel.answers.get(timeout=0.5)
            return False

        def session(context: Any) -> HostedSession:
            return HostedSession(context, relay, channel.abandoned.is_set)

        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
        try:
            train(session)
        finally:
            if (torch := sys.modules.get("torch")) is not None:  # OpenMP's count is per thread
                self._torch_threads = torch.get_num_threads()

    def next(self, lease: str) -> Validation | None:
        """The next validation's Tune result and checkpoint folder; None once the trial ended
        (the lease's channel goes then)."""
        validation = self._channel(lease).out.get()
        if validation is None:
            with self._lock:
                self._channels.pop(lease, None)
        return validation

    def answer(self, lease: str, go_on: bool) -> None:
        """Tune's answer to the last validation: go on, or end the trial there."""
        self._channel(lease).answers.put(go_on)

    def abandon(self, lease: str) -> None:
        """``lease``'s lessee is dead: its trial ends at its next step boundary (or validation),
        or never starts."""
        with self._lock:
            self._abandoned.add(lease)
        self._channel(lease).abandoned.set()


@dataclass
class _Held:
    host: Any
    node: str
    code: str
    lessee: str | None  # the leasing Tune trial's actor id; None while free
    lease: str  # the current (or last) lease's id
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

    def lease(self, node: str, code: str, lessee: str, lease: str) -> tuple[int, Any]:
        """A free live host on ``node`` for ``code`` (a new one when none is free), leased to the
        Tune trial ``lessee`` as ``lease``. Free hosts of other code on the node are retired."""
        while (found := self._take_free(node, code, lessee, lease)) is not None:
            number, host = found
            if not actor_dead(host._actor_id.hex()):  # Ray's OOM killer, a crash (asked unlocked)
                return number, host
            with self._lock:
                self._held.pop(number, None)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self._lock:
            for number, held in list(self._held.items()):
                if held.lessee is None and held.node == node:
                    self._retire(number)
            host = (
                ray.remote(TrialHost)
                .options(
                    num_cpus=0,  # the Tune trial holds the trial's CPUs
                    max_concurrency=8,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                )
                .remote(ray.get_runtime_context().current_actor)
            )
            self._made += 1
            self._held[self._made] = _Held(host, node, code, lessee, lease, time.monotonic())
            return self._made, host

    def _take_free(self, node: str, code: str, lessee: str, lease: str) -> tuple[int, Any] | None:
        with self._lock:
            for number, held in self._held.items():
                if held.lessee is None and held.node == node and held.code == code:
                    held.lessee, held.lease = lessee, lease
                    return number, held.host
        return None

    def release(self, lease: str, reusable: bool) -> None:
        """``lease`` ended: its host is free again, or killed when it cannot be trusted again (a
        stale lease changes nothing)."""
        with self._lock:
            for number, held in list(self._held.items()):
                if held.lease == lease and held.lessee is not None:
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
        """Idle hosts exit. A host whose lessee died is told to end (or never start) that lease's
        trial, then freed once no trial runs there (killed if one still does after
        ``ABANDON_S``, or if the trial failed)."""
        with self._lock:
            leased = {n: (h.lessee, h.lease) for n, h in self._held.items() if h.lessee is not None}
        dead = {
            n: lease for n, (lessee, lease) in leased.items() if lessee is not None and actor_dead(lessee)
        }
        now = time.monotonic()
        with self._lock:
            for number, held in list(self._held.items()):
                if held.lessee is None and now - held.since > self._idle_s:
                    self._retire(number)
            abandoning = {
                n: self._held[n]
                for n, lease in dead.items()
                if n in self._held and self._held[n].lease == lease and not self._held[n].abandoned
            }
        for number, held in abandoning.items():
            try:
                ray.get(held.host.abandon.remote(held.lease), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                with self._lock:
                    if self._held.get(number) is held:
                        self._retire(number)
                continue
            with self._lock:
                held.abandoned, held.since = True, time.monotonic()
        with self._lock:
            abandoned = {n: h for n, h in self._held.items() if h.abandoned}
        for number, held in abandoned.items():
            try:
                state = ray.get(held.host.state.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                state = None  # dead or stuck
            with self._lock:
                if self._held.get(number) is not held:
                    continue
                if state is not None and not state["running"] and not state["failed"]:
                    held.lessee, held.since, held.abandoned = None, time.monotonic(), False
                elif state is None or state["failed"] or time.monotonic() - held.since > ABANDON_S:
                    self._retire(number)


def trial_hosts() -> Any:
    """This job's pool of trial hosts (made by the first search that needs it; its hosts exit
    after the ``trial_hosts.idle_s`` setting's idle seconds, ``GOVRAY_TRIAL_HOST_IDLE_S``, default
    300)."""
    idle_s = load_settings().trial_hosts.idle_s
    return (
        ray.remote(TrialHosts)
        .options(name=POOL_NAME, get_if_exists=True, num_cpus=0, max_concurrency=8)
        .remote(idle_s)
    )


def retire_trial_hosts() -> None:
    """End this job's pool and its hosts (the next search starts fresh ones)."""
    with contextlib.suppress(ValueError):  # there is none
        ray.kill(ray.get_actor(POOL_NAME))


def hosted_trial(params: dict[str, Any], setup: list[Any], hosts: Any, code: str) -> None:
    """The Tune function trainable of a hosted trial: ``search_trial.tune_trial``'s twin, which
    the search registers under that name (Tune restores a search by its trainable's name).
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
        _, host = ray.get(hosts.lease.remote(here.get_node_id(), code, here.get_actor_id(), lease))
        ended = False  # cleanly: the host gave itself back to the pool
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
                    ended = True
                    raise
                ray.get(host.answer.remote(lease, True))
            try:
                ray.get(run)
            except RayTaskError as error:  # the trial's own error, with the host's traceback
                raise error.as_instanceof_cause() from None
            ended = True
        finally:
            if not ended:  # the trial failed, or the host died: it is never lent again
                with contextlib.suppress(Exception):
                    ray.get(hosts.release.remote(lease, False), timeout=30)
