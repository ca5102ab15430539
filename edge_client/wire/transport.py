"""The transport layer's one import path: the MQTT transport, its in-process stand-in, and what both share.

Both transports move opaque byte payloads between topics and deliver incoming
messages through a bounded queue, so the client loop and the round engine are the
same code whichever is used. They never look inside a payload. Each job has its module:

- :mod:`edge_client.wire.transport_base`: the :class:`Transport` interface, :class:`Incoming`, :class:`Will`;
- :mod:`edge_client.wire.inbox`: the bounded, fair receive queue;
- :mod:`edge_client.wire.broker_settings`: the broker URL, login and TLS settings;
- :mod:`edge_client.wire.mqtt_transport`: MQTT over paho, with :mod:`edge_client.wire.connect_failures`
  saying what to fix when a connection fails, and :mod:`edge_client.wire.shared_loop` driving many
  connections of one process from one thread;
- :mod:`edge_client.wire.inproc_transport`: the in-memory broker for simulations and tests;
- :mod:`edge_client.wire.transport_errors`: the errors all of them raise.
"""

from __future__ import annotations

from edge_client.wire.broker_settings import BrokerAddress, BrokerSettings, parse_broker_address, parse_broker_url
from edge_client.wire.inproc_transport import InprocHub, InprocTransport
from edge_client.wire.mqtt_transport import MqttTransport
from edge_client.wire.shared_loop import SharedLoop
from edge_client.wire.transport_base import Incoming, Transport, Will
from edge_client.wire.transport_errors import BrokerUrlError, MessageTooLarge, TlsError, TransportError

__all__ = [
    "TransportError",
    "MessageTooLarge",
    "TlsError",
    "BrokerSettings",
    "BrokerUrlError",
    "BrokerAddress",
    "parse_broker_address",
    "parse_broker_url",
    "Will",
    "Incoming",
    "Transport",
    "MqttTransport",
    "SharedLoop",
    "InprocHub",
    "InprocTransport",
]
