"""API keys (`router.api_keys`): who may call the HTTP API, at what rate and how urgently.

The keys file is YAML, readable by its owner only (mode 0600: any group or other permission is
refused):

    keys:
      - name: team-a            # fairness, limits and metrics go by this name
        key: "sk-..."           # or key_sha256: the hex SHA-256 of the key
        rate_per_s: 5           # optional: requests per second (bursts of up to max(1, rate))
        priority: 0             # optional: the most urgent `priority` it may ask for

A request must carry one as `Authorization: Bearer KEY`. The presented key is hashed and
compared with every stored hash in constant time (`hmac.compare_digest`, no early exit); keys
are never logged. The file is checked for changes at most every `RELOAD_CHECK_S` and reloaded
when it changed; a file that no longer loads keeps the keys in force (and logs why, without
key material).

Thread-safe enough for the router's event loop, its only caller.
"""

import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pdserve.errors import AuthenticationError, ConfigError, RateLimitedError

logger = logging.getLogger(__name__)

RELOAD_CHECK_S = 1.0
MIN_KEY_CHARS = 16


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    digest: bytes  # SHA-256 of the key
    rate_per_s: float | None = None
    priority: int | None = None  # requests asking for a lower (more urgent) one get this

    def priority_for(self, asked: int) -> int:
        return asked if self.priority is None else max(asked, self.priority)


class _Bucket:
    """A token bucket: `rate` tokens a second, at most max(1, rate) held."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.capacity = max(1.0, rate)
        self.tokens = self.capacity
        self.at = now

    def take(self, now: float) -> float:
        """Take a token; returns 0, or the seconds until one is there (nothing taken)."""
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class ApiKeys:
    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        """Load the keys file; raises ConfigError naming what is wrong with it."""
        self.path = Path(path)
        self._clock = clock
        self._stamp = _stamp(self.path)
        self._keys = load_keys(self.path)
        self._checked_at = clock()
        self._buckets: dict[str, _Bucket] = {}

    @property
    def names(self) -> list[str]:
        return [key.name for key in self._keys]

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The key an `Authorization` header carries; raises AuthenticationError."""
        self._reload_if_changed()
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise AuthenticationError(
                "this server requires an API key: send it as `Authorization: Bearer KEY`"
            )
        digest = hashlib.sha256(presented.strip().encode()).digest()
        found: ApiKey | None = None
        for key in self._keys:  # every key compared: the time says nothing of which matched
            if hmac.compare_digest(key.digest, digest):
                found = key
        if found is None:
            raise AuthenticationError("the API key is not valid")
        return found

    def check_rate(self, key: ApiKey) -> None:
        """Count one request of `key`; raises RateLimitedError beyond its `rate_per_s`."""
        if key.rate_per_s is None:
            return
        now = self._clock()
        bucket = self._buckets.get(key.name)
        if bucket is None or bucket.rate != key.rate_per_s:
            bucket = self._buckets[key.name] = _Bucket(key.rate_per_s, now)
        wait_s = bucket.take(now)
        if wait_s:
            raise RateLimitedError(
                f"API key {key.name!r} is limited to {key.rate_per_s:g} requests/s; retry later",
                max(1, round(wait_s * 1000)),
            )

    def _reload_if_changed(self) -> None:
        now = self._clock()
        if now - self._checked_at < RELOAD_CHECK_S:
            return
        self._checked_at = now
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._keys = load_keys(self.path)
        except ConfigError as e:
            logger.error("the API keys file changed but does not load (the keys in force stay): "
                         "%s", e)  # fmt: skip
            return
        logger.info("API keys reloaded from %s: %d keys", self.path, len(self._keys))


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def load_keys(path: Path) -> list[ApiKey]:
    """The keys of a keys file; raises ConfigError (never quoting a key)."""
    try:
        mode = path.stat().st_mode
        if mode & 0o077:
            raise ConfigError(
                f"the API keys file {path} is readable by others (mode {mode & 0o777:o}): "
                f"chmod 600 {path}"
            )
        with open(path, encoding="utf-8") as file:
            document = yaml.safe_load(file)
    except OSError as e:
        raise ConfigError(f"cannot read the API keys file {path}: {e.strerror}") from None
    except yaml.YAMLError:
        raise ConfigError(f"the API keys file {path} is not valid YAML") from None
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"the API keys file {path} needs a non-empty `keys:` list")
    keys = [_key(entry, n, path) for n, entry in enumerate(entries)]
    names = [key.name for key in keys]
    if len(set(names)) != len(names):
        raise ConfigError(f"the API keys file {path} names a key twice")
    if len({key.digest for key in keys}) != len(keys):
        raise ConfigError(f"the API keys file {path} lists one key under two names")
    return keys


def _key(entry: Any, n: int, path: Path) -> ApiKey:
    where = f"key #{n + 1} of {path}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a mapping (name, key, rate_per_s, priority)")
    unknown = sorted(set(entry) - {"name", "key", "key_sha256", "rate_per_s", "priority"})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where} needs a `name`")
    return ApiKey(
        name,
        _digest(entry, f"key {name!r} of {path}"),
        _rate(entry.get("rate_per_s"), name),
        _priority(entry.get("priority"), name),
    )


def _digest(entry: dict[str, Any], where: str) -> bytes:
    key, hashed = entry.get("key"), entry.get("key_sha256")
    if (key is None) == (hashed is None):
        raise ConfigError(f"{where} needs exactly one of `key` and `key_sha256`")
    if key is not None:
        if not isinstance(key, str) or len(key) < MIN_KEY_CHARS:
            raise ConfigError(f"{where}: a key must be a string of {MIN_KEY_CHARS}+ characters")
        return hashlib.sha256(key.encode()).digest()
    try:
        digest = bytes.fromhex(str(hashed))
    except ValueError:
        digest = b""
    if len(digest) != 32:
        raise ConfigError(f"{where}: `key_sha256` must be 64 hex digits")
    return digest


def _rate(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"key {name!r}: `rate_per_s` must be a positive number")
    return float(value)


def _priority(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"key {name!r}: `priority` must be an integer")
    return value
