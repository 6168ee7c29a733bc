"""This host's shared-memory segments (/dev/shm): a live owner's claim on each, and removing
those that killed instances left behind.

A CPU instance keeps its KV cache in a segment its same-host peers write into, and a
tensor-parallel group meets in one. A process that exits cleanly removes its segments; one
that is SIGKILLed, killed by the OOM killer or lost with its Ray node cannot, and a segment's
memory stays taken until someone removes its name — tmpfs pages are host memory that no
process accounts for (16 MiB each for the tiny model, gigabytes for a real one).

So the owner *claims* each segment it creates: it holds a shared `flock` on it for as long as
it lives, and the kernel drops that lock however the process ends. A segment is an orphan when
its owner's process (the pid in its name) is not running and nobody holds a claim on it;
`remove_orphans` removes orphans under an exclusive lock, and every instance runs it as it
creates its KV cache — so a restarted instance removes what its predecessor left.

Both tests are needed: the claim covers owners whose pids this process cannot see (another
pid namespace sharing /dev/shm), the pid covers the instant between creating a segment and
claiming it.
"""

import contextlib
import fcntl
import logging
import os
import re
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"pdserve-(kv|tp)-(\d+)-[0-9a-f]+")


def segment_path(name: str) -> Path:
    """Where segment `name` (with or without multiprocessing's leading slash) lives."""
    return SHM_DIR / name.lstrip("/")


def new_name(kind: str) -> str:
    """A fresh segment name for this process: `pdserve-<kind>-<pid>-<random>`."""
    return f"pdserve-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def claim(name: str) -> int | None:
    """Hold a shared lock on segment `name` for this process's life (or until `release`);
    returns the lock's file descriptor, or None if the name no longer names the segment this
    process opened (a sweep of another pid namespace removed it before the claim)."""
    path = segment_path(name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        still_there = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        still_there = False
    if not still_there:
        os.close(fd)
        return None
    return fd


def release(fd: int | None) -> None:
    """Drop a claim (after removing the segment's name, or when it no longer matters)."""
    if fd is not None:
        os.close(fd)


def left_behind() -> list[Path]:
    """The pdserve segments whose process is not running: orphans, unless claimed (from
    another pid namespace)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    matches = [(name, _NAME.fullmatch(name)) for name in names]
    return [SHM_DIR / name for name, m in matches if m and not running(int(m.group(2)))]


def remove_orphans() -> tuple[int, int]:
    """Remove every pdserve segment whose owner is gone (see the module's docstring); returns
    (segments, bytes) removed and logs them."""
    removed, freed = 0, 0
    for path in left_behind():
        size = _remove_unclaimed(path)
        if size is not None:
            removed, freed = removed + 1, freed + size
    if removed:
        logger.warning(
            "removed %d shared-memory segment(s), %.1f MiB, that killed pdserve processes left "
            "in %s",
            removed,
            freed / 2**20,
            SHM_DIR,
        )
    return removed, freed


def _remove_unclaimed(path: Path) -> int | None:
    """Remove `path` if nobody claims it; its size, or None if it stays (or went already)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its owner lives
        size = os.fstat(fd).st_size
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return size
    finally:
        os.close(fd)


def running(pid: int) -> bool:
    """Whether process `pid` runs here (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
