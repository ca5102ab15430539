"""A device bundle: everything one device needs to reach its broker, in one small TOML file.

``fedge-coordinator provision`` writes one per device; ``fedge-client run --bundle PATH``
reads it. It holds the broker URL, the client id, the MQTT user name and password, the
topic prefix and the CA certificate inline, so a single file copied onto a device's SD
card or image is the whole of its configuration. It holds a password: keep it mode 0600.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from storage.errors import FedgeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Bundle", "BundleError", "read_bundle", "bundle_toml"]


class BundleError(FedgeError, ValueError):
    """A bundle that cannot be used; the message names the file and what to fix."""


@dataclass(frozen=True)
class Bundle:
    broker: str                 # mqtts://HOST:PORT
    client_id: str
    username: str
    password: str
    prefix: str = "fedge"
    ca_cert: str = ""           # PEM text of the CA that signed the broker's certificate ("": the system's CAs)


_REQUIRED = ("broker", "client_id", "username", "password")


def read_bundle(path: Path) -> Bundle:
    """The bundle in ``path``; BundleError for a missing file, bad TOML, unknown or missing keys."""
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"bundle {path} does not exist: copy the device's bundle from the provisioning "
                          "directory (OUT/devices/ID.toml)") from None
    except PermissionError:
        raise BundleError(f"bundle {path} is not readable by this user: make it owned by the user that runs "
                          "fedge-client, mode 0600") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"bundle {path} is not valid TOML ({exc}): copy it again from the provisioning "
                          "directory") from None
    known = set(Bundle.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BundleError(f"bundle {path}: unknown keys {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    missing = [key for key in _REQUIRED if not raw.get(key)]
    if missing:
        raise BundleError(f"bundle {path} lacks {', '.join(missing)}: provision the device again")
    wrong = [key for key, value in raw.items() if not isinstance(value, str)]
    if wrong:
        raise BundleError(f"bundle {path}: {', '.join(wrong)} must be text")
    return Bundle(**raw)


def bundle_toml(bundle: Bundle, *, comment: str = "") -> str:
    """The TOML text of ``bundle`` (the CA certificate as a multi-line string), after ``comment`` lines."""
    import tomli_w   # the coordinator writes bundles; a device only reads them

    head = "".join(f"# {line}\n" if line else "#\n" for line in comment.splitlines())
    values = {key: value for key, value in asdict(bundle).items() if value != ""}
    return head + tomli_w.dumps(values, multiline_strings=True)
