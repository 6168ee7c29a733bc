"""`pdserve up`'s handling of Ray's token authentication (environment only: no Ray here)."""

from pathlib import Path

import pytest

from services.controller import ray_auth


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in (ray_auth.MODE, ray_auth.TOKEN, ray_auth.TOKEN_PATH):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.ray/auth_token
    return monkeypatch


def test_local_ray_gets_token_authentication_with_a_fresh_0600_token(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import os

    path = ray_auth.prepare_local_ray(tmp_path / "state")
    assert path is not None and path.stat().st_mode & 0o777 == 0o600
    first = path.read_text()
    assert os.environ[ray_auth.MODE] == "token" and os.environ[ray_auth.TOKEN_PATH] == str(path)
    assert ray_auth.prepare_local_ray(tmp_path / "state") == path
    assert path.read_text() != first  # a new `up`, a new token


def test_an_explicit_disabled_mode_is_respected_with_a_warning(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clean_env.setenv(ray_auth.MODE, "disabled")
    assert ray_auth.prepare_local_ray(tmp_path) is None
    assert "accepts any client" in caplog.text


def test_joining_without_a_token_is_detected(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert ray_auth.joins_without_token()  # no mode, no token
    clean_env.setenv(ray_auth.MODE, "token")
    assert ray_auth.joins_without_token()  # token mode but nothing to send
    clean_env.setenv(ray_auth.TOKEN_PATH, str(tmp_path / "t"))
    assert not ray_auth.joins_without_token()
