"""Ray's token authentication for `pdserve up`.

A Ray cluster whose GCS accepts any client runs any code a client sends: the measured attack was
a driver on the same network running a task as root. So in local mode `up` starts Ray with token
authentication (`RAY_AUTH_MODE=token`) and a token it generates, kept 0600 in the state dir
(`RAY_AUTH_TOKEN_PATH`); Ray's own processes and the instance actors inherit both variables.
Ray 2.60 binds its servers to every interface whatever `--node-ip-address` says, so the token is
what protects them (docs/security.md). Joining a cluster (`--address`), `up` uses the token the
environment gives it and warns when it joined without one: that cluster accepts anyone.

Must run before `ray` is imported: Ray reads its authentication mode once, at import.
"""

import logging
import os
from pathlib import Path

from pdserve.rpc.auth import secret_file

logger = logging.getLogger(__name__)

MODE = "RAY_AUTH_MODE"
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
TOKEN = "RAY_AUTH_TOKEN"


def token_file(state_dir: Path) -> Path:
    return state_dir / "ray_token"


def prepare_local_ray(state_dir: Path) -> Path | None:
    """Turn on token authentication for the Ray that `up` is about to start, with a fresh
    token; returns its file, or None when the operator switched Ray's authentication off
    explicitly (`RAY_AUTH_MODE=disabled`: warned about, not overridden)."""
    if os.environ.get(MODE, "").lower() == "disabled":
        logger.warning(
            "RAY_AUTH_MODE=disabled: the local Ray accepts any client on this machine's network "
            "and runs what it sends; unset it to let pdserve up turn token authentication on"
        )
        return None
    path = token_file(state_dir)
    path.unlink(missing_ok=True)
    secret_file(path)
    os.environ[MODE] = "token"
    os.environ[TOKEN_PATH] = str(path)
    os.environ.pop(TOKEN, None)
    return path


def joins_without_token() -> bool:
    """Whether this process would join a Ray cluster without a token (then a cluster that
    lets it in accepts unauthenticated clients)."""
    return os.environ.get(MODE, "").lower() != "token" or not (
        os.environ.get(TOKEN) or os.environ.get(TOKEN_PATH) or _default_token().exists()
    )


def warn_unauthenticated(address: str) -> None:
    logger.warning(
        "joining the Ray cluster at %s without an authentication token: if it lets us in, it "
        "accepts unauthenticated clients, and any of them can run code on its nodes. Run it with "
        "RAY_AUTH_MODE=token and a token on every node, and give `up` the token (docs/security.md)",
        address,
    )


def _default_token() -> Path:
    return Path.home() / ".ray" / "auth_token"
