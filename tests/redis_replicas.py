"""A replicated Redis for tests, as operators run one: Debian's `redis-server` as a primary and
a replica, and `redis-sentinel` watching them, each a child process on a free loopback port.
Locked as a managed Redis is: the default user is off, pdserve logs in as an ACL user with a
generated password, the Sentinel requires its own password, and with `tls=True` every server
and the Sentinel speak TLS only (a self-signed certificate, which clients name as their CA)."""

import secrets
import subprocess
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import redis
from waiting import wait_for

from pdserve.storage.redis_server import _free_port

PRIMARY_NAME = "pdserve-primary"
USER = "pdserve"
HOST = "127.0.0.1"
USER_COMMANDS = "+@read +@write +@scripting +@connection -@dangerous"
SENTINEL_COMMANDS = (
    "+multi +slaveof +ping +exec +subscribe +config|rewrite +role +publish +info +client|setname "
    "+client|kill +script|kill"
)


class _Server:
    def __init__(
        self, name: str, workdir: Path, lines: list[str], sentinel: bool, tls: bool
    ) -> None:
        self.name = name
        self.port = _free_port(HOST)
        self.config = workdir / f"{name}.conf"
        self.log = workdir / f"{name}.log"
        ports = [f"tls-port {self.port}", "port 0"] if tls else [f"port {self.port}"]
        self.config.write_text("\n".join([*ports, f"logfile {self.log}", *lines, ""]))
        self.config.chmod(0o600)
        binary = "redis-sentinel" if sentinel else "redis-server"
        self.process = subprocess.Popen(
            [binary, str(self.config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class ReplicatedRedis:
    def __init__(self, workdir: Path, tls: bool = False) -> None:
        self.workdir = workdir
        self.tls = tls
        self.password = secrets.token_urlsafe(24)
        self.sentinel_password = secrets.token_urlsafe(24)
        self.internal_password = secrets.token_urlsafe(24)  # not pdserve's users'
        self.ca = workdir / "redis-cert.pem"
        self.servers: dict[str, _Server] = {}

    # -- what clients use ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The Sentinel URL pdserve is configured with (a secret)."""
        scheme = "rediss+sentinel" if self.tls else "redis+sentinel"
        query = f"sentinel_password={quote(self.sentinel_password)}"
        if self.tls:
            query += f"&ssl_ca_certs={quote(str(self.ca))}"
        return (
            f"{scheme}://{USER}:{quote(self.password)}@{HOST}:{self.servers['sentinel'].port}"
            f"/{PRIMARY_NAME}/0?{query}"
        )

    def direct_url(self, name: str) -> str:
        """One server's own URL, for `redis_client` without Sentinels."""
        scheme, query = (
            ("rediss", f"?ssl_ca_certs={quote(str(self.ca))}") if self.tls else ("redis", "")
        )
        return f"{scheme}://{USER}:{quote(self.password)}@{HOST}:{self.servers[name].port}/0{query}"

    def client(self, name: str) -> redis.Redis:
        """An administrator's client of one server (`primary`, `replica`)."""
        return redis.Redis(
            HOST, self.servers[name].port, username="admin", password=self.internal_password,
            socket_timeout=2, **self._tls_kwargs(),
        )  # fmt: skip

    def sentinel(self) -> redis.Redis:
        return redis.Redis(
            HOST, self.servers["sentinel"].port, password=self.sentinel_password,
            socket_timeout=2, decode_responses=True, **self._tls_kwargs(),
        )  # fmt: skip

    def primary_port(self) -> int:
        """The port of the server the Sentinel names primary now."""
        _, port = self.sentinel().sentinel_get_master_addr_by_name(PRIMARY_NAME)
        return int(port)

    def _tls_kwargs(self) -> dict[str, object]:
        return {"ssl": True, "ssl_ca_certs": str(self.ca)} if self.tls else {}

    # -- processes ----------------------------------------------------------------------------

    def __enter__(self) -> "ReplicatedRedis":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        if self.tls:
            self._make_certificate()
        primary = self._server("primary", []).port
        self._server(
            "replica",
            [f"replicaof {HOST} {primary}", "masteruser replication",
             f"masterauth {self.internal_password}"],
        )  # fmt: skip
        wait_for(self._replica_in_sync, 30)
        self._sentinel(primary)
        wait_for(self._sentinel_sees_replica, 30)

    def kill(self, name: str) -> None:
        self.servers[name].stop()

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()

    def _server(self, name: str, lines: list[str]) -> _Server:
        acl = [  # pdserve's user as docs/operations/cluster.md recommends; the replica's and
            # the Sentinel's as Redis's own documentation does
            "user default off",
            f"user {USER} on >{self.password} resetchannels ~pds:* {USER_COMMANDS}",
            f"user replication on >{self.internal_password} +psync +replconf +ping",
            f"user sentinel on >{self.internal_password} allchannels {SENTINEL_COMMANDS}",
            f"user admin on >{self.internal_password} ~* &* +@all",  # the tests' own look
            f"bind {HOST}", 'save ""', "appendonly no", f"dir {self.workdir}",
        ]  # fmt: skip
        server = _Server(name, self.workdir, [*acl, *self._tls_lines(), *lines], False, self.tls)
        self.servers[name] = server
        wait_for(lambda: self._answers(server), 15)
        return server

    def _sentinel(self, primary: int) -> _Server:
        lines = [
            f"bind {HOST}", f"dir {self.workdir}", f"requirepass {self.sentinel_password}",
            f"sentinel monitor {PRIMARY_NAME} {HOST} {primary} 1",
            f"sentinel auth-user {PRIMARY_NAME} sentinel",
            f"sentinel auth-pass {PRIMARY_NAME} {self.internal_password}",
            f"sentinel down-after-milliseconds {PRIMARY_NAME} 500",
            f"sentinel failover-timeout {PRIMARY_NAME} 5000",
        ]  # fmt: skip
        server = _Server("sentinel", self.workdir, [*lines, *self._tls_lines()], True, self.tls)
        self.servers["sentinel"] = server
        wait_for(lambda: self._answers(server, sentinel=True), 15)
        return server

    def _tls_lines(self) -> list[str]:
        if not self.tls:
            return []
        key = self.workdir / "redis-key.pem"
        return [
            f"tls-cert-file {self.ca}", f"tls-key-file {key}",
            f"tls-ca-cert-file {self.ca}", "tls-auth-clients no", "tls-replication yes",
        ]  # fmt: skip

    def _make_certificate(self) -> None:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-keyout", str(self.workdir / "redis-key.pem"), "-out", str(self.ca),
             "-subj", "/CN=localhost", "-addext", f"subjectAltName=IP:{HOST},DNS:localhost"],
            check=True, capture_output=True,
        )  # fmt: skip

    def _answers(self, server: _Server, sentinel: bool = False) -> bool:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited: {server.log.read_text()[-2000:]}")
        try:
            return bool((self.sentinel() if sentinel else self.client(server.name)).ping())
        except redis.RedisError:
            return False

    def _replica_in_sync(self) -> bool:
        info = self.client("replica").info("replication")
        return info.get("master_link_status") == "up"

    def _sentinel_sees_replica(self) -> bool:
        replicas = self.sentinel().sentinel_slaves(PRIMARY_NAME)
        return any(not r["is_sdown"] and not r["is_disconnected"] for r in replicas)


def wait_for_failover(group: ReplicatedRedis, old_port: int, timeout_s: float = 60) -> float:
    """Seconds until the Sentinel names another primary."""
    started = time.monotonic()
    wait_for(lambda: group.primary_port() != old_port, timeout_s)
    return time.monotonic() - started
