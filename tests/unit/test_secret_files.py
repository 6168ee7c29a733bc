"""Secret files: made 0600 in a private directory, never trusted when others could have set or
read them."""

import os
from pathlib import Path

import pytest

from pdserve.errors import ConfigError
from pdserve.rpc.auth import secret_file


def test_a_secret_is_created_0600_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "state" / "cluster_secret"
    secret = secret_file(path)
    assert len(secret) >= 40 and path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert secret_file(path) == secret
    assert [p.name for p in path.parent.iterdir()] == ["cluster_secret"]  # no temporary left


def test_a_secret_others_could_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cluster_secret"
    path.write_text("planted-by-someone\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0600"):
        secret_file(path)


def test_a_symlinked_secret_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("x\n")
    target.chmod(0o600)
    (tmp_path / "cluster_secret").symlink_to(target)
    with pytest.raises(ConfigError, match="cannot use"):
        secret_file(tmp_path / "cluster_secret")


def test_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="not yours alone"):
        secret_file(shared / "cluster_secret")
    assert not (shared / "cluster_secret").exists()


def test_a_configured_secret_is_used_as_is(tmp_path: Path) -> None:
    assert secret_file(tmp_path / "unused", configured="given") == "given"
    assert not (tmp_path / "unused").exists()
