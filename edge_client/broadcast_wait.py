"""A device's wait for a task's model broadcast, and why it failed when it is given up.

A task names its model by the hash of a broadcast on the retained model topic, and the broadcast
may come after the task or not at all (the device may not read the topic, the broker may have
restarted and forgotten it). The device subscribes to the model topic only while a task waits, so
that a long-lived device does not receive every model, and answers with an error halfway through
the task's timeout, so that the coordinator counts the attempt failed and retries it rather than
counting it late. What came meanwhile is kept to tell the person at the device why. The wait
is on one topic at a time: the model topic, or the delta topic when the device holds the model
the task's delta broadcast applies to (and back to the model topic if the delta fails its checks).
"""

from __future__ import annotations

from edge_client.device_actions import Actions, Task

__all__ = ["BROADCAST_PATIENCE", "BroadcastWait"]

BROADCAST_PATIENCE = 0.5   # share of a task's timeout spent waiting for its model broadcast


class BroadcastWait:
    """At most one task waiting for its broadcast (a newer task takes the place of the one before),
    with what the model topic and the connection did meanwhile; the caller passes the time in."""

    def __init__(self, model_topic: str) -> None:
        self.model_topic = model_topic
        self.topic = model_topic                  # the topic waited on (subscribed while a task waits)
        self.disconnects = 0                      # the transport's count of lost connections so far
        self._waiting: tuple[Task, float] | None = None   # the task waiting, since when
        self._seen: list[str] = []                # what came on the model topic meanwhile, for the error
        self._disconnects_before = 0

    @property
    def task(self) -> Task | None:
        """The task waiting for its broadcast, if one does."""
        return self._waiting[0] if self._waiting is not None else None

    def begin(self, task: Task, now: float, out: Actions, topic: str | None = None) -> None:
        """Wait for ``task``'s broadcast on ``topic`` (the model topic by default): subscribe to it unless
        already waiting there."""
        topic = topic or self.model_topic
        if self._waiting is None:
            self._seen, self._disconnects_before = [], self.disconnects
            out.subscribe.append((topic, True))
        elif topic != self.topic:
            out.unsubscribe.append((self.topic, True))
            out.subscribe.append((topic, True))
        self.topic = topic
        self._waiting = (task, now)

    def switch(self, topic: str, out: Actions) -> None:
        """Go on waiting for the same task on ``topic`` (the full model after a delta that failed), within the
        same patience."""
        if self._waiting is not None and topic != self.topic:
            out.unsubscribe.append((self.topic, True))
            out.subscribe.append((topic, True))
            self.topic = topic

    def stop(self, out: Actions) -> None:
        """Drop the topic once nothing waits: the next models are of no use to this device."""
        if self._waiting is not None:
            self._waiting = None
            out.unsubscribe.append((self.topic, True))

    def saw(self, seen: str) -> None:
        """Keep what came on the model topic for a task's error, only while one waits (a device lives long)."""
        if self._waiting is not None:
            self._seen = [*self._seen[-2:], seen]

    def came(self, digest: str, now: float, out: Actions) -> Task | None:
        """The broadcast ``digest`` is held now: the task that waited for it, if one did, can run."""
        waiting = self._waiting
        if waiting is None or waiting[0].body is None or waiting[0].body.broadcast != digest:
            return None
        task, since = waiting
        self.stop(out)
        task.fetch_seconds = now - since
        return task

    def expired(self, now: float, out: Actions) -> Task | None:
        """The waiting task once its wait is over, to be answered with an error.

        The coordinator's attempt ends at the full timeout: an error sent then would count
        as late, while one sent halfway counts as failed and lets the coordinator retry,
        which publishes the broadcast again.
        """
        if self._waiting is None:
            return None
        task, since = self._waiting
        if now - since <= BROADCAST_PATIENCE * task.timeout:
            return None
        self.stop(out)
        task.no_broadcast = self.explain(task)
        return task

    def due(self) -> float | None:
        """When the waiting task's wait is over, for a caller that sleeps between events."""
        if self._waiting is None:
            return None
        task, since = self._waiting
        return since + BROADCAST_PATIENCE * task.timeout

    def explain(self, task: Task) -> str:
        """Why a task's broadcast is not here, from what this device observed while it waited."""
        digest = task.body.broadcast if task.body is not None else None
        said = (f"the model broadcast {(digest or '')[:16]}... did not arrive within "
                f"{BROADCAST_PATIENCE * task.timeout:.0f} s (half the task's timeout)")
        dropped = self.disconnects - self._disconnects_before
        if dropped:
            return (f"{said}; the connection to the broker dropped {dropped} time(s) meanwhile (a broker that "
                    "restarts without persistence forgets the broadcast; the coordinator publishes it again on "
                    "its retry)")
        if self._seen:
            return f"{said}; the model topic brought only {'; '.join(self._seen[-3:])}"
        return (f"{said}, and nothing came on {self.topic}: check that this device may read that topic "
                "(the broker's ACL)")
