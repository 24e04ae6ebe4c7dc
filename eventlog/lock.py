"""The single-writer lock: an exclusive, non-blocking ``flock`` on ``<db>.lock``.

flock locks belong to the open file description, so the kernel drops them when
the holder exits for any reason (SIGKILL included); there is no stale lock to
clean up.  The file is never deleted: unlinking it would let a later writer
lock a fresh inode while an older one still holds the unlinked one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket

from .errors import ReadOnlyLocationError, StorageError, WriterLockedError

__all__ = ["WriterLock", "lock_path_for"]

_READ_ONLY_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}


def lock_path_for(db_path: str) -> str:
    """Path of the sidecar lock file of a log: next to the file itself, so that a symlink to the
    log takes the same lock."""
    return os.path.realpath(db_path) + ".lock"


def _describe_holder(fd: int) -> tuple[int | None, str | None]:
    """Read "pid host" written by the current holder (may be empty if it just started)."""
    try:
        raw = os.pread(fd, 256, 0).decode("utf-8", "replace").split()
    except OSError:
        return None, None
    pid = int(raw[0]) if raw and raw[0].isdigit() else None
    host = raw[1] if len(raw) > 1 else None
    return pid, host


def _open_lock_file(path: str) -> tuple[int, bool]:
    """The lock file's descriptor, and whether this call created it. Another creator's release can
    unlink the file between a failed O_EXCL open and the reopen: the O_EXCL open is tried once more
    then (a second loss of that race is an error, as any other)."""
    for last_try in (False, True):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), True
        except FileExistsError:
            try:
                return os.open(path, os.O_RDWR | os.O_CLOEXEC), False
            except FileNotFoundError:
                if last_try:
                    raise
    raise AssertionError("unreachable")


class WriterLock:
    """Holds the writer lock of one log until :meth:`release`."""

    def __init__(self, db_path: str):
        self.path = lock_path_for(db_path)
        self._fd: int | None = None

    def acquire(self) -> WriterLock:
        """Take the lock now or raise WriterLockedError naming the holder's pid."""
        try:
            fd, created = _open_lock_file(self.path)
        except OSError as e:
            if e.errno in _READ_ONLY_ERRNOS:
                raise ReadOnlyLocationError(f"cannot write lock file {self.path}: {e.strerror}") from None
            raise StorageError(f"cannot create lock file {self.path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, host = _describe_holder(fd)
            os.close(fd)
            who = f"pid {pid}" if pid is not None else "an unknown pid"
            if host:
                who += f" on {host}"
            raise WriterLockedError(
                f"log {self.path[:-5]} is already open for writing by {who}", pid=pid, host=host
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        try:
            self._write_owner(fd)
        except OSError as e:  # a full disk or quota: the lock is not kept, and says why in one line
            if created:
                self.release_and_remove()
            else:
                self.release()
            raise StorageError(f"cannot write lock file {self.path}: {e.strerror or e}") from None
        return self

    @staticmethod
    def _write_owner(fd: int) -> None:
        """Record our pid and host so a refused writer can say who holds the lock."""
        owner = f"{os.getpid()} {socket.gethostname()}\n".encode()
        os.pwrite(fd, owner, 0)
        os.ftruncate(fd, len(owner))

    def release_and_remove(self) -> None:
        """Remove the lock file, then release the lock: for a creator whose log was never made
        (or whose lock file could not be written), so that it leaves nothing behind. Safe although
        the file is otherwise kept: two creators racing on two inodes are kept apart by the log's
        own creation (a hard link that only one of them can make)."""
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass  # a file left is harmless: the next acquire takes it as it is
        self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Release the lock (idempotent); closing the descriptor drops the flock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    # A handle dropped without close() must not keep the log locked for the
    # rest of the process (raw descriptors are not closed by the GC).
    __del__ = release
