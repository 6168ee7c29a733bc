"""Membership: which instances the router may send a request to.

An instance is *routable* when it is a member (added, not removed), not drained (an operator
asked for no new requests; in-flight ones finish) and not unhealthy (a recent failure on it; it
becomes healthy again after `cooldown_s`, or at once when its KV-event stream shows it alive).

Locking: one `threading.Lock` guards every field; each method holds it for its whole body and
neither blocks nor calls out while holding it. The admin API, the supervisor, the KV-event
threads and request handlers call it from their own threads; the state changes only through
these methods.
"""

import threading
import time
from collections.abc import Sequence, Set
from enum import StrEnum

from pdserve.errors import ConfigError, NoCapacityError

UNHEALTHY_COOLDOWN_S = 5.0


class Role(StrEnum):
    """The router's two candidate lists: a mixed instance takes the prefill role."""

    PREFILL = "prefill"
    DECODE = "decode"


class Membership:
    """The instances of each role, in the order they were added."""

    def __init__(
        self,
        prefill: Sequence[str] = (),
        decode: Sequence[str] = (),
        *,
        mixed: bool = False,
        cooldown_s: float = UNHEALTHY_COOLDOWN_S,
    ) -> None:
        if mixed and decode:
            raise ConfigError("a router serves either mixed instances or prefill + decode pairs")
        self.mixed = mixed  # the prefill role's instances are mixed instances
        self.cooldown_s = cooldown_s
        self._lock = threading.Lock()
        self._members = {Role.PREFILL: list(prefill), Role.DECODE: list(decode)}
        self._drained: set[str] = set()
        self._leaving: set[str] = set()  # drained because they are shutting down (SIGTERM)
        self._unhealthy_until: dict[str, float] = {}

    # -- reading ------------------------------------------------------------------------------

    def members(self, role: Role) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._members[role])

    def __contains__(self, address: object) -> bool:
        with self._lock:
            return any(address in members for members in self._members.values())

    def is_drained(self, address: str) -> bool:
        with self._lock:
            return address in self._drained

    def is_leaving(self, address: str) -> bool:
        """Drained because it said it is shutting down (not by an operator): an instance
        restarted in its place is not drained."""
        with self._lock:
            return address in self._leaving

    def routable(self, role: Role) -> list[str]:
        """The members of `role` that are neither drained nor unhealthy now."""
        now = time.monotonic()
        with self._lock:
            return [
                i
                for i in self._members[role]
                if i not in self._drained and self._unhealthy_until.get(i, 0.0) <= now
            ]

    def readable(self, role: Role) -> list[str]:
        """The members of `role` not marked unhealthy, drained ones included: a drained
        instance still serves its cached KV while its streams move away."""
        now = time.monotonic()
        with self._lock:
            return [i for i in self._members[role] if self._unhealthy_until.get(i, 0.0) <= now]

    def candidates(self, role: Role, excluded: Set[str]) -> list[str]:
        """The instances of `role` to choose from, best first by kind: routable and not
        `excluded` (those a failed attempt of this request blamed); else routable; else
        unhealthy but not excluded; else every undrained member. Raises NoCapacityError when
        the role has no undrained member."""
        healthy = self.routable(role)
        preferred = [i for i in healthy if i not in excluded]
        if preferred or healthy:
            return preferred or healthy
        with self._lock:
            undrained = [i for i in self._members[role] if i not in self._drained]
        chosen = [i for i in undrained if i not in excluded] or undrained
        if not chosen:
            raise NoCapacityError(f"no {role} instance is available", 1000)
        return chosen

    # -- changing -----------------------------------------------------------------------------

    def add(self, role: Role, address: str) -> None:
        """Make `address` a member of `role` (a no-op when it is one)."""
        with self._lock:
            if address not in self._members[role]:
                self._members[role].append(address)

    def remove(self, address: str) -> None:
        """Forget `address` in every role, with its drained and unhealthy marks."""
        with self._lock:
            for members in self._members.values():
                if address in members:
                    members.remove(address)
            self._drained.discard(address)
            self._leaving.discard(address)
            self._unhealthy_until.pop(address, None)

    def set_drained(self, address: str, drained: bool) -> None:
        """Drain `address` (no new requests) or resume it."""
        with self._lock:
            if drained:
                self._drained.add(address)
            else:
                self._drained.discard(address)
                self._leaving.discard(address)

    def set_leaving(self, address: str) -> None:
        """Drain `address` because it is shutting down."""
        with self._lock:
            self._drained.add(address)
            self._leaving.add(address)

    def mark_unhealthy(self, address: str) -> None:
        """Prefer other instances to `address` for `cooldown_s`."""
        with self._lock:
            self._unhealthy_until[address] = time.monotonic() + self.cooldown_s

    def mark_healthy(self, address: str) -> None:
        with self._lock:
            self._unhealthy_until.pop(address, None)
