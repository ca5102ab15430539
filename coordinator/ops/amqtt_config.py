"""What the embedded amqtt broker is told: its listener, its logins and its topic rules.

Anonymous access is off and each login's password is hashed as amqtt's FileAuthPlugin
expects; with device logins, each device may only use its own topics, as the shipped
Mosquitto ACL allows.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from coordinator.ops.broker_endpoint import BrokerError

__all__ = ["hash_password", "amqtt_config", "topic_acl"]


def hash_password(password: str) -> str:
    """Hash *password* in the Argon2 format amqtt's FileAuthPlugin verifies.

    amqtt 0.12 reads ``user:hash`` lines and verifies them with pwdlib's
    Argon2 hasher (legacy ``$6$`` sha512-crypt lines are still accepted but
    deprecated, and cannot be generated).  The parameters are intentionally
    cheap: the password is 256 random bits, so a slow hash adds no security,
    whereas the default cost (64 MiB, 3 passes, ~100 ms) would be paid inside
    the broker's event loop on every CONNECT and stall message delivery while
    a fleet of clients (re)connects.
    """
    try:
        from pwdlib.hashers.argon2 import Argon2Hasher
    except ImportError as exc:  # pragma: no cover - dependency problem
        raise BrokerError(
            "the embedded broker needs 'pwdlib' with argon2 support "
            "(installed with amqtt>=0.12; try: pip install 'pwdlib[argon2]')"
        ) from exc
    return Argon2Hasher(time_cost=1, memory_cost=8192, parallelism=1).hash(password)


def amqtt_config(host: str, port: int, password_file: Path, acl: dict[str, Any] | None) -> dict[str, Any]:
    """amqtt 0.12 broker configuration: a listener on ``host:port``, logins from ``password_file``, and
    ``acl`` (:func:`topic_acl`) when devices have logins of their own.

    Only the two auth plugins are loaded: the default plugin set also
    contains packet/event loggers (noise) and the $SYS plugin, which
    publishes every 20 s and warns about its psutil dependency.  Listing
    ``plugins`` explicitly also keeps amqtt from falling back to the
    deprecated entry-point plugin discovery.  Both auth plugins must agree
    (amqtt ANDs the answers of all auth plugins that give one), so a
    client without a username is refused by AnonymousAuthPlugin and a
    wrong password by FileAuthPlugin.
    """
    bind = f"[{host}]" if ":" in host else host
    return {
        "listeners": {
            "default": {"type": "tcp", "bind": f"{bind}:{port}"},
        },
        # None: sessions of clean_session=False clients never expire while the
        # broker runs, so an edge device may be offline for a whole round.
        "session_expiry_interval": None,
        "plugins": {
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": False},
            "amqtt.plugins.authentication.FileAuthPlugin": {
                "password_file": str(password_file),
            },
            **({"amqtt.plugins.topic_checking.TopicAccessControlListPlugin": acl} if acl is not None else {}),
        },
    }


def topic_acl(prefix: str, coordinator_user: str, devices: Iterable[str]) -> dict[str, Any]:
    """Topic rules by user: the coordinator anywhere, each device on its own topics only.

    Without them any spawned client could answer for another or forge its errors;
    the rules are by user name, which the password proves (a client id proves nothing).
    """
    own = {d: f"{prefix}/clients/{d}/#" for d in devices}
    # amqtt 0.12's plugin Config names the subscribe rules `acl` (and warns that the name is
    # deprecated in favour of a `subscribe-acl` its Config does not accept yet).
    warnings.filterwarnings("ignore", message="The 'acl' option is deprecated", category=DeprecationWarning)
    return {
        "publish_acl": {coordinator_user: ["#"], **{d: [topic] for d, topic in own.items()}},
        "acl": {coordinator_user: ["#"],
                **{d: [topic, f"{prefix}/coordinator/#"] for d, topic in own.items()}},
    }
