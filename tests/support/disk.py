"""A small file system to fill: a tmpfs of a given size, and a filler that leaves a set amount free."""

from __future__ import annotations

import errno
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's size=, e.g. "1m") mounted at `where`/tmpfs (root only, else the
    test is skipped), unmounted afterwards."""
    mount = where / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(directory: Path, leave: int) -> Path:
    """Fill the file system of `directory` until `leave` bytes are free; return the filler's path."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            f.write(bytes(max(shutil.disk_usage(directory).free - leave, 0)))
        except OSError as err:
            assert err.errno == errno.ENOSPC
    return filler
