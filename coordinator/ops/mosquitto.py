"""Start a local Mosquitto with a config fedge can rely on (tests, benchmarks, labs).

The config raises ``max_queued_messages``: Mosquitto's default of 1000 silently drops
QoS 1 messages for a slow subscriber. The process is ours: it is stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from coordinator.ops.broker import BrokerError, free_port

__all__ = ["mosquitto_binary", "LocalMosquitto"]


def mosquitto_binary() -> str | None:
    found = shutil.which("mosquitto")
    if found:
        return found
    return "/usr/sbin/mosquitto" if os.access("/usr/sbin/mosquitto", os.X_OK) else None


class LocalMosquitto:
    """Mosquitto on 127.0.0.1 on a free port, with its own config file and log."""

    def __init__(self, *, workdir: Path | None = None, extra_config: str = "", persistence: bool = False,
                 config: str | None = None, port: int = 0) -> None:
        """``config``: a whole configuration of its own (a provisioned ``fedge.conf``: TLS listener, passwords,
        ACL) instead of the generated anonymous one, whose listener is on ``port``."""
        if (config is None) != (port == 0):
            raise ValueError("a configuration of its own comes with the port its listener is on, and only then")
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fedge-mosquitto-"))
        self.extra_config = extra_config
        self.persistence = persistence   # retained messages and sessions saved in workdir (on exit, autosave 1 s)
        self.config = config
        self.port = port
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def pid(self) -> int | None:
        """The broker process's id while it runs (to sample or signal exactly this broker)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0, *, same_port: bool = False) -> str:
        """Start the broker on a free port (``same_port``: the port of its last start, to play a restart)."""
        binary = mosquitto_binary()
        if binary is None:
            raise BrokerError("mosquitto is not installed: apt-get install mosquitto")
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.config is None and not (same_port and self.port):
            self.port = free_port()
        conf = self.workdir / "mosquitto.conf"
        saved = ["persistence true", f"persistence_location {self.workdir}/", "autosave_interval 1"]
        lines = [self.config.rstrip("\n")] if self.config is not None else [
            f"listener {self.port} 127.0.0.1", "allow_anonymous true",
            *(saved if self.persistence else ["persistence false"]), "max_queued_messages 100000"]
        lines += ["log_dest stderr", "log_type error", "log_type warning"]
        if os.geteuid() == 0 and not any(line.startswith("user ") for line in "\n".join(lines).splitlines()):
            lines.append("user root")   # otherwise it drops to 'mosquitto', which may not read our files
        conf.write_text("\n".join(lines) + "\n" + self.extra_config, encoding="utf-8")
        self._log = open(self.workdir / "mosquitto.log", "ab")
        self._proc = subprocess.Popen([binary, "-c", str(conf)], cwd=self.workdir, stdout=self._log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self.url
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    log = (self.workdir / "mosquitto.log").read_text(errors="replace")
                    raise BrokerError(f"mosquitto did not start on port {self.port}: {log.strip()}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LocalMosquitto":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
