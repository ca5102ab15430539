"""A device whose client id does not match its MQTT user name under fedge's ACL says so.

With ``use_username_as_clientid`` and the ACL's ``pattern readwrite PREFIX/clients/%u/#``,
such a device may neither publish its presence nor read its tasks, and MQTT reports
neither: the device would log "online" and never be seen.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from coordinator.ops.mosquitto import LocalMosquitto, mosquitto_binary
from edge_client.client import ClientSettings, EdgeClient
from edge_client.objectives import LocalData
from edge_client.wire.transport import BrokerSettings, MqttTransport

ACL = ("user coordinator\ntopic readwrite fedge/#\n"
       "pattern readwrite fedge/clients/%u/#\npattern read fedge/coordinator/#\n")


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory):
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed")
    workdir = tmp_path_factory.mktemp("acl-broker")
    (workdir / "fedge.acl").write_text(ACL)
    with LocalMosquitto(workdir=workdir, extra_config=f"acl_file {workdir / 'fedge.acl'}\n"
                                                      "use_username_as_clientid true\n") as broker:
        yield broker.url


def _errors_of_a_client(url: str, client_id: str, username: str, protocol: str, caplog) -> list[str]:
    transport = MqttTransport(BrokerSettings(url=url, username=username, protocol=protocol), client_id).connect()
    data = LocalData(torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.int64))
    client = EdgeClient(ClientSettings(client_id=client_id, presence_echo_timeout=1.5), transport, data)
    stop = threading.Event()
    with caplog.at_level(logging.ERROR):
        thread = threading.Thread(target=client.run, args=(stop,), daemon=True)
        thread.start()
        # Until it complains, or well past its presence echo's 1.5 s deadline: a complaint would have come by then.
        deadline = time.monotonic() + 3.0
        while not _errors(caplog) and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        thread.join(5)
    transport.close()
    return _errors(caplog)


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_a_client_id_that_is_not_the_user_name_is_reported(acl_broker, protocol, caplog):
    errors = _errors_of_a_client(acl_broker, "pi-02", "pi-01", protocol, caplog)
    assert any("--client-id must equal the MQTT --username" in e or "client id must equal its MQTT user name" in e
               for e in errors), errors


def test_a_matching_client_id_is_seen_without_complaint(acl_broker, caplog):
    assert _errors_of_a_client(acl_broker, "pi-01", "pi-01", "3.1.1", caplog) == []


def test_a_device_cannot_read_another_devices_task_where_secure_aggregation_routes_its_shares(acl_broker):
    """A secure round's forwarded shares travel in each device's own task (docs/privacy.md): under the ACL,
    a device subscribing to another's task topic receives nothing, while the addressee does."""
    def connect(user: str) -> MqttTransport:
        return MqttTransport(BrokerSettings(url=acl_broker, username=user, protocol="3.1.1"), user).connect()

    coordinator, owner, snoop = connect("coordinator"), connect("pi-01"), connect("pi-02")
    try:
        owner.subscribe("fedge/clients/pi-01/task")
        snoop.subscribe("fedge/clients/pi-01/task")
        snoop.subscribe("fedge/clients/+/task")
        coordinator.publish("fedge/clients/pi-01/task", b"sealed shares for pi-01")
        got = owner.get(5.0)
        assert got is not None and got.payload == b"sealed shares for pi-01"
        assert snoop.get(1.0) is None
    finally:
        for t in (coordinator, owner, snoop):
            t.close()
