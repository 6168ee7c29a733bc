"""The cluster secret of this test session: every instance a test starts requires it, and every
client a test makes sends it (security stays on in tests)."""

from pdserve.rpc.auth import new_secret
from pdserve.rpc.channels import ChannelPool

SECRET = new_secret()


def channels() -> ChannelPool:
    """Channels that authenticate with the session's secret."""
    return ChannelPool(SECRET)
