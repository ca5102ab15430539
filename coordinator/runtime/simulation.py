"""Many simulated clients in one process: the device's own client code, run by a few workers.

With the inproc transport each spawned client is an :class:`~edge_client.client.EdgeClient`
with its own connection to the in-process hub, as a device has to its broker, but none has
a thread. A dispatcher thread learns from the hub which clients have mail (its own
connection, subscribed to every client's task, status and presence topics and to the
coordinator's) and hands those clients to ``workers`` threads; a worker steps a client
(:meth:`EdgeClient.step`) until its inbox is empty, then takes the next. Every half
second each client is stepped once more, for its re-sends and time-outs.

So the tasks of N selected clients cost their compute, ``workers`` at a time, instead of
N threads contending for the interpreter; and since networks are cached per worker, the
model broadcast once for all clients and each client's data is a view of one shared array
(:func:`edge_client.data.arrange_clients`), an idle client holds no network and no data.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import torch
from torch import nn

from edge_client.client import BroadcastCache, EdgeClient, ModelCache
from edge_client.wire.protocol import Topics
from edge_client.wire.transport import InprocHub, InprocTransport

__all__ = ["ClientPool", "available_cores", "worker_count"]

log = logging.getLogger("fedge.simulation")

TICK = 0.5   # seconds between the steps every client gets for what is due (re-sends, time-outs)


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def worker_count(workers: int) -> int:
    """``sim.workers`` resolved: 0 is one worker per core."""
    return workers if workers > 0 else available_cores()


class _WorkerModels(ModelCache):
    """One network cache per worker thread: a network is used by one task at a time."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    def get(self, spec: Any) -> nn.Module:
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = ModelCache()
        return cache.get(spec)


class ClientPool:
    """Simulated clients on one hub, served by ``workers`` threads.

    Build each client with the pool's ``models`` and ``broadcasts``, :meth:`add` it, then
    :meth:`start`. Each worker runs torch with ``cores // workers`` intra-op threads, so that
    workers x threads = cores; the thread that starts the pool (the coordinator's, which
    evaluates the global model) keeps its own count.
    """

    def __init__(self, hub: InprocHub, topics: Topics, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a client pool needs at least one worker, got {workers}")
        self.hub = hub
        self.topics = topics
        self.workers = workers
        self.models: ModelCache = _WorkerModels()
        self.broadcasts = BroadcastCache()
        self.clients: dict[str, EdgeClient] = {}
        self._ready: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._state: dict[str, str] = {}   # client id -> "queued", "running" or "again" (mail while running)
        self._left: set[str] = set()

    def add(self, client: EdgeClient) -> None:
        self.clients[client.settings.client_id] = client

    def start(self, stop: threading.Event) -> list[threading.Thread]:
        """Start the dispatcher and the workers; they end when ``stop`` is set."""
        doorbell = self.hub.connect("simulation-dispatcher")
        for kind in ("task", "status", "presence"):
            doorbell.subscribe(self.topics.all_clients(kind))
        for topic in (self.topics.coordinator_status, self.topics.model, self.topics.model + "/+",
                      self.topics.model_delta, self.topics.model_delta + "/+"):
            doorbell.subscribe(topic)
        # torch.set_num_threads sets the calling thread's OpenMP thread count and the default of
        # threads that have not used torch yet: each worker takes its count, then the default is
        # set back to this thread's.
        own = torch.get_num_threads()
        ready = threading.Barrier(self.workers + 1)
        per_worker = max(1, available_cores() // self.workers)
        workers = [threading.Thread(target=self._work, args=(per_worker, ready), name=f"sim-worker-{i}",
                                    daemon=True) for i in range(self.workers)]
        for worker in workers:
            worker.start()
        ready.wait()
        torch.set_num_threads(own)
        dispatcher = threading.Thread(target=self._dispatch, args=(doorbell, workers, stop),
                                      name="sim-dispatcher", daemon=True)
        dispatcher.start()
        return [dispatcher, *workers]

    # -- the dispatcher ------------------------------------------------------------
    def _dispatch(self, doorbell: InprocTransport, workers: list[threading.Thread], stop: threading.Event) -> None:
        try:
            for client in self.clients.values():
                client.start()
            self._ring_all()
            next_tick = time.monotonic() + TICK
            while not stop.is_set():
                incoming = doorbell.get(0.1)
                while incoming is not None:
                    self._ring(incoming.topic)
                    incoming = doorbell.get(0.0)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + TICK
                    self._ring_all()
        finally:
            doorbell.close()
            for _ in workers:
                self._ready.put(None)
            for worker in workers:
                worker.join()
            for cid, client in self.clients.items():
                if cid not in self._left:
                    client.leave()

    def _ring(self, topic: str) -> None:
        """Mail on ``topic``: its client has something to do (every client, for the coordinator's topics)."""
        cid = self.topics.client_of(topic)
        if cid is None:
            self._ring_all()
        elif cid in self.clients:
            self._schedule(cid)

    def _ring_all(self) -> None:
        for cid in self.clients:
            self._schedule(cid)

    def _schedule(self, cid: str) -> None:
        with self._lock:
            if cid in self._left:
                return
            state = self._state.get(cid)
            if state is None:
                self._state[cid] = "queued"
                self._ready.put(cid)
            elif state == "running":
                self._state[cid] = "again"

    # -- the workers -----------------------------------------------------------------
    def _work(self, torch_threads: int, ready: threading.Barrier) -> None:
        torch.set_num_threads(torch_threads)
        torch.get_num_threads()   # torch reads the default at a thread's first use: use it now, with ours
        ready.wait()
        while (cid := self._ready.get()) is not None:
            with self._lock:
                self._state[cid] = "running"
            client = self.clients[cid]
            try:
                while client.step(0.0):
                    pass
                left = client.finished
                if left:
                    client.leave()
            except Exception:   # one client's failure must not stop the others
                log.exception("simulated client %s failed", cid)
                left = False
            with self._lock:
                if left:
                    self._left.add(cid)
                if self._state.pop(cid) == "again" and not left:
                    self._state[cid] = "queued"
                    self._ready.put(cid)
