"""ApiKeys: the keys file (owner-only, validated, reloaded when it changes), bearer keys checked
against every stored hash, a rate per key and a priority floor."""

import hashlib
import logging
from pathlib import Path

import pytest
import yaml

from pdserve.errors import AuthenticationError, ConfigError, RateLimitedError
from services.router.api_keys import RELOAD_CHECK_S, ApiKeys

ALICE, BOB = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef0"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write(path: Path, keys: list[dict[str, object]], mode: int = 0o600) -> Path:
    path.write_text(yaml.safe_dump({"keys": keys}))
    path.chmod(mode)
    return path


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    hashed = hashlib.sha256(BOB.encode()).hexdigest()
    return write(
        tmp_path / "keys.yaml",
        [
            {"name": "alice", "key": ALICE, "rate_per_s": 2, "priority": 3},
            {"name": "bob", "key_sha256": hashed},
        ],
    )


def test_a_bearer_key_names_its_owner_and_anything_else_is_refused(keys_file: Path) -> None:
    keys = ApiKeys(keys_file)
    assert keys.authenticate(f"Bearer {ALICE}").name == "alice"
    assert keys.authenticate(f"bearer {BOB}").name == "bob"  # stored as its hash only
    for header in (None, "", ALICE, f"Basic {ALICE}", "Bearer ", f"Bearer {ALICE}x"):
        with pytest.raises(AuthenticationError):
            keys.authenticate(header)


def test_a_key_s_priority_is_a_floor_and_its_rate_a_token_bucket(keys_file: Path) -> None:
    clock = Clock()
    keys = ApiKeys(keys_file, clock)
    alice = keys.authenticate(f"Bearer {ALICE}")
    assert (alice.priority_for(-5), alice.priority_for(7)) == (3, 7)
    keys.check_rate(alice)
    keys.check_rate(alice)  # a burst of rate_per_s
    with pytest.raises(RateLimitedError, match="2 requests/s") as limited:
        keys.check_rate(alice)
    assert limited.value.retry_after_ms == 500
    clock.now += 0.5
    keys.check_rate(alice)
    bob = keys.authenticate(f"Bearer {BOB}")
    for _ in range(100):
        keys.check_rate(bob)  # no rate: no limit


def test_the_file_is_reloaded_when_it_changes_and_a_broken_one_keeps_the_keys(
    keys_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    keys = ApiKeys(keys_file, clock)
    write(keys_file, [{"name": "carol", "key": ALICE + "-new"}])
    assert keys.authenticate(f"Bearer {ALICE}").name == "alice"  # checked at most every second
    clock.now += RELOAD_CHECK_S
    with pytest.raises(AuthenticationError):
        keys.authenticate(f"Bearer {ALICE}")
    assert keys.authenticate(f"Bearer {ALICE}-new").name == "carol"
    keys_file.write_text("keys: [{name: dave, key: short}]")
    clock.now += RELOAD_CHECK_S
    with caplog.at_level(logging.ERROR):
        assert keys.authenticate(f"Bearer {ALICE}-new").name == "carol"
    assert "does not load" in caplog.text and ALICE not in caplog.text


@pytest.mark.parametrize(
    ("entries", "mode", "message"),
    [
        ([{"name": "a", "key": ALICE}], 0o644, "chmod 600"),
        ([], 0o600, "non-empty `keys:`"),
        ([{"key": ALICE}], 0o600, "needs a `name`"),
        ([{"name": "a", "key": "short"}], 0o600, "16\\+ characters"),
        ([{"name": "a", "key": ALICE, "key_sha256": "00" * 32}], 0o600, "exactly one"),
        ([{"name": "a", "key_sha256": "zz"}], 0o600, "64 hex digits"),
        ([{"name": "a", "key": ALICE}, {"name": "a", "key": BOB}], 0o600, "twice"),
        ([{"name": "a", "key": ALICE}, {"name": "b", "key": ALICE}], 0o600, "two names"),
        ([{"name": "a", "key": ALICE, "rate_per_s": 0}], 0o600, "positive"),
        ([{"name": "a", "key": ALICE, "limit": 3}], 0o600, "unknown field"),
    ],
)
def test_a_bad_keys_file_is_refused_without_quoting_a_key(
    tmp_path: Path, entries: list[dict[str, object]], mode: int, message: str
) -> None:
    path = write(tmp_path / "keys.yaml", entries, mode)
    with pytest.raises(ConfigError, match=message) as refused:
        ApiKeys(path)
    assert ALICE not in str(refused.value) and BOB not in str(refused.value)
