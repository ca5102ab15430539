"""Where messages go: the topic layout under a prefix, and the ids that become topic levels.

Each device only writes and reads its own topics, so a broker ACL keyed on the
client id confines it; that is why an id may not contain a topic separator or wildcard.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edge_client.wire.errors import ProtocolError

__all__ = ["Topics", "valid_client_id", "ID_PATTERN"]

ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"   # a client (or worker) id, as a regular expression
_ID_RE = re.compile(ID_PATTERN)


def valid_client_id(client_id: str) -> bool:
    """Client ids become topic levels, so they may not contain ``/``, ``+`` or ``#``."""
    return isinstance(client_id, str) and bool(_ID_RE.fullmatch(client_id))


@dataclass(frozen=True)
class Topics:
    """Topic layout under a configurable prefix.

    Each device only writes ``PREFIX/clients/ID/{presence,result}`` and reads
    ``PREFIX/clients/ID/{task,status}`` plus the coordinator's status, so a broker
    ACL of ``pattern readwrite PREFIX/clients/%u/#`` confines it to its own topics.
    """

    prefix: str = "fedge"

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "+#") or self.prefix.endswith("/"):
            raise ProtocolError(f"bad topic prefix {self.prefix!r}: no '+', '#' or trailing '/'")

    def client(self, client_id: str, kind: str) -> str:
        return f"{self.prefix}/clients/{client_id}/{kind}"

    def all_clients(self, kind: str) -> str:
        return f"{self.prefix}/clients/+/{kind}"

    @property
    def coordinator_status(self) -> str:
        return f"{self.prefix}/coordinator/status"

    @property
    def model(self) -> str:
        """The round's model broadcast (retained), which tasks reference by its SHA-256."""
        return f"{self.prefix}/coordinator/model"

    @property
    def model_delta(self) -> str:
        """The round's delta broadcast (retained): the model as a difference from the one before
        (``codec.down_delta``), which tasks reference by its SHA-256 beside the full broadcast."""
        return f"{self.prefix}/coordinator/delta"

    @property
    def manifest(self) -> str:
        """The current exchange's tasks for the aggregation workers (retained)."""
        return f"{self.prefix}/coordinator/manifest"

    def worker(self, worker_id: str, kind: str) -> str:
        return f"{self.prefix}/workers/{worker_id}/{kind}"

    def all_workers(self, kind: str) -> str:
        return f"{self.prefix}/workers/+/{kind}"

    def shared_results(self, group: str) -> str:
        """Every device's results, shared among a group of subscribers (MQTT 5 shared subscription):
        the broker hands each message to one member."""
        return f"$share/{group}/{self.all_clients('result')}"

    def client_of(self, topic: str) -> str | None:
        """The client id a per-client topic belongs to, or None for any other topic."""
        return self._owner(topic, "clients")

    def worker_of(self, topic: str) -> str | None:
        """The worker id a per-worker topic belongs to, or None for any other topic."""
        return self._owner(topic, "workers")

    def _owner(self, topic: str, level: str) -> str | None:
        parts = topic[len(self.prefix) + 1:].split("/") if topic.startswith(self.prefix + "/") else []
        return parts[1] if len(parts) == 3 and parts[0] == level else None
