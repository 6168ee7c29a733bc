"""ServedRole: which role (prefill, decode, mixed) an instance serves now.

An instance's gRPC servicers ask it for the role object on every call instead of holding one, so
that `change` swaps the role in place (`pdserve admin role`): the runtime under it — the engine
with its weights, its KV cache and prefix cache, the gRPC server, the output subscriptions and
KV-event streams — stays. A call for a role the instance no longer serves is refused as
UNAVAILABLE, which the router retries on another instance.
"""

import threading
from typing import Protocol, TypeVar

from pdserve.engine.engine import LLMEngine
from pdserve.errors import InstanceUnavailableError, PdserveError
from pdserve.instance.runtime import InstanceRole, InstanceRuntime
from pdserve.v1 import common_pb2


class Role(InstanceRole, Protocol):
    """A role object: it serves its role's RPCs on `runtime`, which it does not own."""

    ROLE: str  # prefill | decode | mixed
    runtime: InstanceRuntime

    def on_tick(self, engine: LLMEngine) -> None:
        """Engine thread, between steps: the role's housekeeping."""
        ...

    def reserved(self) -> tuple[int, int]:
        """The reservations the role holds and their blocks (decode's), for its load reports.
        Engine thread."""
        ...

    def leave(self, error: PdserveError) -> None:
        """Stop serving: end every request the role still holds with `error` (the router
        continues or retries it elsewhere) and release what the role holds beyond the runtime
        (transports, reservations)."""
        ...

    def stop(self) -> None:
        """Stop the runtime (the instance ends), with what the role holds."""
        ...

    def check_integrity(self) -> None:
        """Call when idle: the runtime's blocks (and the role's reservations) add up."""
        ...


R = TypeVar("R")


class ServedRole:
    """Thread-safe: `get` from any handler thread, `change` from the actor's."""

    def __init__(self, role: Role) -> None:
        self.runtime = role.runtime
        self._role = role
        self._lock = threading.Lock()
        self._attach(role)

    @property
    def name(self) -> str:
        return self._role.ROLE

    @property
    def current(self) -> Role:
        return self._role

    def get(self, kind: type[R]) -> R:
        """The role object if it is a `kind`; raises InstanceUnavailableError otherwise."""
        role = self._role
        if not isinstance(role, kind):
            raise InstanceUnavailableError(f"this instance serves the {role.ROLE} role now")
        return role

    def change(self, role: Role) -> Role:
        """Serve `role` from now on (same runtime); returns the previous one, for the caller to
        `leave`."""
        if role.runtime is not self.runtime:
            raise ValueError("a role changes in place: on the same runtime")
        with self._lock:
            previous, self._role = self._role, role
            self._attach(role)
        return previous

    def _attach(self, role: Role) -> None:
        runtime = self.runtime
        runtime.role = role.ROLE
        runtime.stage_metrics.role = role.ROLE
        runtime.on_tick = role.on_tick
        runtime.reserved = role.reserved

    # -- InstanceService (InstanceRole) ---------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        return self._role.abort(request_id)

    def stats(self) -> common_pb2.InstanceStats:
        return self._role.stats()
