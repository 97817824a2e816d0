"""How the package opens the files of a run: the one home of two rules every read and write follows.

* **No write follows a symbolic link.** A file is opened for writing with ``O_NOFOLLOW`` (:func:`open_no_follow`),
  or written whole to a temporary file beside it that is then renamed over it (:func:`write_file_atomically`); a
  link at either name is refused by name (``ValueError``), never written through and never replaced. Writing
  through a link would change a file anywhere else (another run's records, a user's file).
* **Only regular files are read or written.** A FIFO, a socket, a device or a directory where a file is expected is
  refused by name (``ValueError``) instead of being opened the ordinary way: opening a FIFO blocks until another
  process opens its other end, which would hang a run (and no signal ends a process blocked there). Files are
  opened with ``O_NONBLOCK``, which never blocks whatever the file is, and their type is checked on the open
  descriptor (``fstat``), so a file swapped in between a check and the open is refused too.

Reading follows links (:func:`open_regular`): a link to a log or a checkpoint elsewhere is read, never written.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Optional

__all__ = ["open_no_follow", "open_regular", "read_small_file", "refuse_symlink", "refuse_unsafe_file",
           "write_file_atomically"]

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _not_regular(path, mode: int) -> ValueError:
    return ValueError(f"{path} is {_kind(mode)}, not a regular file: megatron-mech reads and writes only regular "
                      f"files there (a FIFO would block the run). Remove it, or choose another directory")


def refuse_symlink(path) -> None:
    """``ValueError`` naming ``path`` when it is a symbolic link. A run writes only regular files inside its
    directories: writing through a link would change a file anywhere else (another run's records, a user's
    file), and replacing the link would silently drop what the user put there."""
    path = Path(path)
    if path.is_symlink():
        try:
            target = f" (to {os.readlink(path)})"
        except OSError:
            target = ""
        raise ValueError(f"{path} is a symbolic link{target}: a run writes this file itself and does not follow "
                         f"links out of its directory. Remove the link, or choose another directory")


def refuse_unsafe_file(path) -> None:
    """``ValueError`` naming ``path`` when it is a symbolic link (:func:`refuse_symlink`) or exists and is not a
    regular file (a FIFO, a socket, a device, a directory). A missing file passes: the run creates it."""
    refuse_symlink(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)


def _checked_descriptor(fd: int, path) -> int:
    """``fd`` once it is known to be a regular file, blocking again; else closed and ``ValueError`` naming it."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, mode)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def _open_descriptor(path, flags: int, create_mode: int = 0o666) -> int:
    """``os.open`` with ``O_NONBLOCK | O_CLOEXEC`` of a regular file; a FIFO, socket, device or directory is a
    ``ValueError`` naming it, as is a symbolic link when ``flags`` hold ``O_NOFOLLOW``."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, create_mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and flags & os.O_NOFOLLOW:
            refuse_symlink(path)
        if exc.errno in (errno.ENXIO, errno.EISDIR, errno.ENODEV, errno.EOPNOTSUPP):
            # a FIFO without a reader or a socket (ENXIO), a directory (EISDIR): say what it is
            try:
                mode = os.stat(path).st_mode
            except OSError:
                raise exc from None
            if not stat.S_ISREG(mode):
                raise _not_regular(path, mode) from None
        raise
    return _checked_descriptor(fd, path)


_WRITE_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                "r+": os.O_RDWR}


def open_no_follow(path, mode: str = "w", encoding: Optional[str] = None, buffering: int = -1):
    """``open(path, mode, buffering)`` for writing (``mode``: ``w``, ``a`` or ``r+``, with ``b`` for bytes) that
    never writes through a symbolic link and never blocks: opened with ``O_NOFOLLOW | O_NONBLOCK``, so a link
    planted after any earlier check is refused as well, and a FIFO, socket, device or directory at ``path`` is
    refused (``ValueError`` naming it) instead of waiting for a reader."""
    binary = "b" in mode
    fd = _open_descriptor(path, _WRITE_FLAGS[mode.replace("b", "")] | os.O_NOFOLLOW)
    return os.fdopen(fd, mode.replace("b", "") + "b" if binary else mode, buffering,
                     encoding=None if binary else encoding)


def open_regular(path, mode: str = "rb", encoding: Optional[str] = None):
    """``open(path, mode)`` for reading (``rb`` or ``r``) that never blocks: a FIFO, socket, device or directory
    at ``path`` is refused (``ValueError`` naming it), whatever is found there when it is opened. Links are
    followed (a read changes nothing). A missing file raises ``FileNotFoundError`` as ``open`` does."""
    if mode not in ("rb", "r"):
        raise ValueError(f"open_regular reads: mode 'rb' or 'r', got {mode!r}")
    return os.fdopen(_open_descriptor(path, os.O_RDONLY), mode, encoding=encoding)


def read_small_file(path, max_bytes: int, what: str) -> bytes:
    """The whole of a file that is small by design (a tracker, a run id, a summary), through
    :func:`open_regular`; one larger than ``max_bytes`` is a ``ValueError`` naming it, ``what`` it is and the
    bound, read no further (a damaged or foreign file cannot take the reader's memory)."""
    with open_regular(path) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes:,} bytes, more than {what} holds: not read")
    return data


def write_file_atomically(path, content) -> None:
    """Replace ``path`` with ``content`` atomically, through ``.<name>.tmp`` beside it: readers see the old file
    or the new one, never a part. ``content``: a ``str`` (written as UTF-8), ``bytes``, or a function that writes
    into the binary file it is given (e.g. ``lambda f: torch.save(state, f)``). A symbolic link or a file that is
    not regular (a FIFO, a directory) at either name is refused (``ValueError`` naming it): the temporary file
    would be written through it, and the replace would drop it. When the write fails (a full disk, a file-size
    limit; ``torch.save`` then raises ``RuntimeError``) the temporary file is removed and the error raised: a
    failed write leaves the old file and nothing else."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    refuse_unsafe_file(path)
    f = open_no_follow(tmp, "wb")  # refuses what is at the temporary name, leaving it there
    try:
        with f:
            if isinstance(content, str):
                f.write(content.encode("utf-8"))
            elif isinstance(content, (bytes, bytearray)):
                f.write(content)
            else:
                content(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # the regular file opened above
        raise
