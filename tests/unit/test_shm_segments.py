"""Removing the shared-memory segments killed processes left in /dev/shm: a segment goes only
when the process named in it is not running and nobody claims it (the kernel drops a claim
however its holder dies, SIGKILL included)."""

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.model.shm_segments import SHM_DIR, claim, new_name, release, remove_orphans

# A child that makes a segment as an instance does (named after its own pid, claimed), says
# its name and waits.
OWNER = """
import os, sys
from pdserve.model.shm_segments import SHM_DIR, claim, new_name
name = new_name("kv")
fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 4096)
assert claim(name) is not None
print(name, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def made() -> Iterator[list[Path]]:
    """Segments a test makes by hand; removed at the end if still there."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def owner() -> tuple[subprocess.Popen[str], Path]:
    child = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    return child, SHM_DIR / child.stdout.readline().strip()


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def segment(made: list[Path], name: str) -> Path:
    path = SHM_DIR / name
    path.write_bytes(b"\0" * 4096)
    made.append(path)
    return path


def test_a_segment_whose_owner_was_killed_is_removed(made: list[Path]) -> None:
    child, path = owner()
    made.append(path)
    try:
        remove_orphans()
        assert path.exists()  # its owner runs
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    remove_orphans()  # (another test's instance may have run it first)
    assert not path.exists()


def test_a_claimed_segment_stays_though_its_pid_is_not_running_here(made: list[Path]) -> None:
    """An owner in another pid namespace sharing /dev/shm: its pid means nothing here."""
    unnamed = segment(made, new_name("unnamed"))  # claimed before it matches a sweep's pattern
    held = claim(unnamed.name)
    assert held is not None
    path = SHM_DIR / f"pdserve-kv-{dead_pid()}-0123abcd"
    unnamed.rename(path)
    made.append(path)
    try:
        remove_orphans()
        assert path.exists()
    finally:
        release(held)
    remove_orphans()
    assert not path.exists()


def test_an_unclaimed_segment_of_a_running_process_stays(made: list[Path]) -> None:
    """The instant between creating a segment and claiming it (or an owner that never claims)."""
    path = segment(made, new_name("tp"))
    remove_orphans()
    assert path.exists()


def test_other_files_stay(made: list[Path]) -> None:
    dead = dead_pid()
    paths = [segment(made, f"{prefix}-{dead}-0123abcd") for prefix in ("other-kv", "pdserve-x")]
    remove_orphans()
    assert all(path.exists() for path in paths)


def test_a_claim_on_a_name_gone_before_it_is_none(made: list[Path]) -> None:
    path = segment(made, new_name("kv"))
    os.unlink(path)
    assert claim(path.name) is None
