"""Bytes that survive a crash: atomic replacement of a file and durable appends to one.

    write_atomically("run/model.ckpt", payload)     # the old file, or the new one: never half
    fd = open_for_append("run/privacy.ledger")
    append_durably(fd, b"...\\n", "run/privacy.ledger")   # on disk when it returns

Checkpoints (``engine.py``) are replaced whole; the privacy ledger (``privacy/ledger.py``) grows by
appends. Both follow the rules a database follows for its files.

# Note [Atomic replacement]
``write_atomically`` writes a temporary file in the target's own directory (``os.replace`` is
atomic only within one file system), flushes and fsyncs it, renames it over the target, and
fsyncs the directory so that the rename itself is on disk. A process killed, or a write that
fails (a full disk: ENOSPC, a file size limit: EFBIG), at any point before the rename leaves the
previous file untouched; one killed after it leaves the new file, complete. On a failure that
Python sees the temporary file is removed. A process killed mid-write leaves its temporary file
behind, named ``.<name>.<host>.<pid>.<random>.tmp``: nothing reads it, and the next write of
the same target from the same host removes it once that pid is gone (a checkpoint-sized file
per kill would otherwise fill the disk over many restarts; another host's, or a live process's,
may be a save in progress and is left alone). tests/privacy/test_faults.py kills saves.

# Note [Durable appends]
``append_durably`` writes the whole record and fsyncs before it returns. A short write (the
disk filled mid-record) is cut back to the file's previous length and raised, so the file holds
only whole records plus, after a power cut mid-append, at most one torn last record, which the
reader drops (Note [A torn last record] in privacy/ledger.py).
"""
from __future__ import annotations

import errno
import os
import socket
import tempfile


def fsync_directory(directory: str) -> None:
    """Make the directory's entries (a new or renamed file) durable."""
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, data: bytes | memoryview) -> None:
    """Replace ``path`` by ``data``, all or nothing (Note [Atomic replacement])."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    prefix = f".{os.path.basename(path)}.{socket.gethostname()}."
    _remove_orphans(directory, prefix)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_directory(directory)


def _remove_orphans(directory: str, prefix: str) -> None:
    """Remove this host's temporary files of killed writes (Note [Atomic replacement])."""
    for name in os.listdir(directory):
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid = name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                     # someone else's process
        return True
    return True


def open_for_append(path: str) -> int:
    """A descriptor that appends to ``path``, created (durably) if missing."""
    path = os.fspath(path)
    existed = os.path.exists(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    if not existed:
        fsync_directory(os.path.dirname(os.path.abspath(path)))
    return fd


def append_durably(fd: int, data: bytes, path: str) -> None:
    """Append ``data`` whole and fsync, or leave the file as it was and raise
    (Note [Durable appends])."""
    before = os.fstat(fd).st_size
    try:
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes (disk full?)",
                          path)
        os.fsync(fd)
    except BaseException:
        try:
            os.ftruncate(fd, before)
        except OSError:
            pass
        raise
