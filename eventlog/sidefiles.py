"""Large payloads in content-addressed side files beside the log (docs/log-format.md).

A commit whose events carry payloads over ``SIDE_FILE_BYTES`` writes them, one after the other,
into one file ``<log>.payloads/<name>``, fsynced and renamed into place (and its directory
fsynced) *before* the transaction that references them: an event is durable only with its
payload. The name is the sha256 of the pieces' sha256 digests, so the file is named by its
content; each row's ``payload_ref`` is ``name:offset:length:sha256`` and a read checks the
piece's sha256, so a missing or damaged file is a one-line CorruptLogError naming it and the seq.
One file per commit: a commit of many large traces pays one fsync for all of them.
"""

from __future__ import annotations

import hashlib
import os

from .errors import CorruptLogError, SideFileLeftError, StorageError

SIDE_FILE_BYTES = 100 * 1024


def side_dir(log_path: str) -> str:
    return f"{log_path}.payloads"


def remove_orphans(log_path: str, referenced: set[str]) -> list[str]:
    """Delete the side files no row references (a crash between a file and its commit leaves one;
    a half-written ``.tmp-`` one too); return their names. Files of other names are not orch's
    and are left alone. Only the writer calls it, under its lock."""
    try:
        names = sorted(os.listdir(side_dir(log_path)))
    except FileNotFoundError:
        return []
    orphans = [name for name in names if _is_side_file(name) and name not in referenced]
    for name in orphans:
        try:
            os.unlink(os.path.join(side_dir(log_path), name))
        except OSError as err:
            raise SideFileLeftError(
                f"cannot remove the unreferenced payload file {name}: {err.strerror or err}"
            ) from None
    return orphans


def _is_side_file(name: str) -> bool:
    """A side file's name (64 hex digits), or its temporary name while written."""
    digest = name.split(".tmp-", 1)[0]
    return len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)


def write_side_file(log_path: str, pieces: list[bytes]) -> list[str]:
    """Write `pieces` into one durable side file; return each piece's reference."""
    digests = [hashlib.sha256(piece).digest() for piece in pieces]
    name = hashlib.sha256(b"".join(digests)).hexdigest()
    directory = side_dir(log_path)
    final = os.path.join(directory, name)
    if not os.path.exists(final):  # the same content, already durable (a retried commit)
        tmp = f"{final}.tmp-{os.getpid()}"
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "wb") as f:
                f.writelines(pieces)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:  # nothing of the commit is stored: its transaction never starts
            raise StorageError(f"cannot write the payload file {final}: {err.strerror or err}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    refs, offset = [], 0
    for piece, digest in zip(pieces, digests, strict=True):
        refs.append(f"{name}:{offset}:{len(piece)}:{digest.hex()}")
        offset += len(piece)
    return refs


def read_side_payload(log_path: str, seq: int, ref: str) -> bytes:
    """The payload a row references, checked against its sha256."""
    try:
        name, offset, length, digest = ref.split(":")
        start, size = int(offset), int(length)
    except ValueError:
        raise CorruptLogError(f"{log_path}: seq {seq}: bad payload reference {ref!r}") from None
    path = os.path.join(side_dir(log_path), name)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            piece = f.read(size)
    except FileNotFoundError:
        raise CorruptLogError(f"{log_path}: seq {seq}: its payload file {path} is missing") from None
    except OSError as err:
        raise CorruptLogError(f"{log_path}: seq {seq}: cannot read its payload file {path}: {err.strerror}") from None
    if len(piece) != size or hashlib.sha256(piece).hexdigest() != digest:
        raise CorruptLogError(f"{log_path}: seq {seq}: its payload file {path} is damaged (sha256 mismatch)")
    return piece
