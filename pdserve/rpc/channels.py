"""ChannelPool: one long-lived gRPC channel per peer address, shared by threads."""

import threading
import time
from collections.abc import Callable

import grpc

from pdserve.rpc.auth import authenticated_channel
from pdserve.rpc.tls import TlsFiles

MAX_MESSAGE_BYTES = 64 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a peer that dies without closing its connections (host down, SIGKILL behind a NAT) fails
    # open streams within keepalive_time + keepalive_timeout instead of at their deadline
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # a peer that was down is dialled again within a second (gRPC's default backoff grows to
    # 2 minutes, during which calls fail at once: a restarted instance would stay unused)
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # accept the clients' keepalive pings (the default minimum interval is 5 minutes)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
# a forgotten channel is closed this much later (see `ChannelPool.forget`)
CLOSE_FORGOTTEN_AFTER_S = 5.0


class ChannelPool:
    """Thread-safe. With `secret`, every call on its channels carries `Bearer <secret>` (the
    cluster secret instances check); without, calls are anonymous (health checks). With `tls`,
    channels are mutual TLS (the instance plane's `cluster.tls_*`). With
    `forget_unused_after_s`, a channel nobody took for that long is forgotten (see `forget`):
    for a pool whose calls are all shorter, to peers that come and go (an instance's); not for
    one that holds streams open for hours (the router's, which forgets removed instances)."""

    def __init__(
        self,
        secret: str | None = None,
        tls: TlsFiles | None = None,
        *,
        forget_unused_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._secret = secret
        self._tls = tls
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self.close_forgotten_after_s = CLOSE_FORGOTTEN_AFTER_S
        self._forget_unused_after_s = forget_unused_after_s
        self._clock = clock
        self._taken: dict[str, float] = {}  # when each channel was last taken
        self._next_sweep = 0.0

    @property
    def secret(self) -> str | None:
        return self._secret

    @property
    def tls(self) -> TlsFiles | None:
        return self._tls

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                if self._tls is not None:
                    channel = self._tls.channel(address, CHANNEL_OPTIONS)
                else:
                    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                if self._secret:
                    channel = authenticated_channel(channel, self._secret)
                self._channels[address] = channel
            unused = self._take(address)
        for forgotten in unused:
            self._close_later(forgotten)
        return channel

    def forget(self, address: str, keep: Callable[[], bool] = lambda: False) -> None:
        """Drop `address`'s channel, unless `keep()` (asked under the pool's lock: no `get`
        runs meanwhile) says its peer is back: a later `get` dials it anew; the channel itself
        is closed `close_forgotten_after_s` later (calls still on it are cancelled). For a peer
        that is gone: its channel holds ~30 KB for good and dials it every second until gRPC's
        idle timeout (30 min). The wait is for whoever took the channel just before: a call
        started on a closed channel crashes grpcio 1.85."""
        with self._lock:
            if keep():
                return
            channel = self._channels.pop(address, None)
            self._taken.pop(address, None)
        if channel is not None:
            self._close_later(channel)

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._taken.clear()

    def _take(self, address: str) -> list[grpc.Channel]:
        """Note that `address`'s channel was taken now; pop and return those nobody took for
        `forget_unused_after_s` (looked for four times in that span at most). Under the lock."""
        if self._forget_unused_after_s is None:
            return []
        now = self._clock()
        self._taken[address] = now
        if now < self._next_sweep:
            return []
        self._next_sweep = now + self._forget_unused_after_s / 4
        unused = [a for a, at in self._taken.items() if now - at > self._forget_unused_after_s]
        for forgotten in unused:
            del self._taken[forgotten]
        return [self._channels.pop(forgotten) for forgotten in unused]

    def _close_later(self, channel: grpc.Channel) -> None:
        closing = threading.Timer(self.close_forgotten_after_s, channel.close)
        closing.daemon = True
        closing.start()
