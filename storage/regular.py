"""The one way hpsearch opens a file it did not just create itself: only a regular file, never a FIFO, device or
socket (a FIFO planted in a shared runs folder would hang the reader, or a writer, for good), and in a runs folder
never through a link, nor inside a folder that became a link since the output folder was resolved at start.

``O_NONBLOCK`` makes the open itself return at once whatever the file is (a FIFO without a writer, a tape drive);
the file's type is then checked on the open descriptor (``fstat``), so what is checked is what is read. The trainer
reads its run's files through here too: a runs folder is storage's (docs/architecture.md, "Who may tell a worker
what"), and this module imports nothing of ours.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import IO, Any

NOT_REGULAR = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
    stat.S_IFLNK: "a link",
}


class NotRegularFile(OSError):
    """A path hpsearch reads or writes is not a regular file where one belongs (or lies behind a link)."""

    def __str__(self) -> str:
        return str(self.strerror)  # the message alone, without "[Errno 22]": it is shown to the user as is


def kind(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO")."""
    return NOT_REGULAR.get(stat.S_IFMT(mode), "not a regular file")


def unmoved(path: Path) -> bool:
    """Whether the folder ``path`` lies in is where its name says: no link on the way to it. Every path of a runs
    folder is built from the output folder as resolved at start, so a folder swapped for a link since (the output
    folder itself, a study or trial folder) makes this False, and hpsearch neither writes nor deletes there."""
    folder = os.path.abspath(path.parent)
    while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)  # a folder not made yet: the nearest one that is must be no link
    return os.path.realpath(folder) == folder


def check_unmoved(path: Path) -> None:
    """Raise NotRegularFile where :func:`unmoved` is False."""
    if not unmoved(path):
        raise NotRegularFile(
            errno.ELOOP,
            f"{path}: its folder is now reached through a link ({os.path.realpath(path.parent)}), not the output "
            "folder resolved at start; hpsearch writes and deletes through none",
        )


def open_fd(path: Path, flags: int = os.O_RDONLY, mode: int = 0o600, *, follow: bool = False) -> int:
    """A descriptor of ``path``, a regular file (raises NotRegularFile otherwise, FileNotFoundError if absent):
    opened without blocking and, unless ``follow`` (a data file or model folder the user names), without following
    a link, in a folder no link leads to. The descriptor blocks again once checked, like any other."""
    if not follow:
        check_unmoved(path)
    nofollow = 0 if follow else os.O_NOFOLLOW
    try:
        fd = os.open(path, flags | nofollow | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:  # O_NOFOLLOW's answer for a link
            raise NotRegularFile(errno.ELOOP, f"{path} is a link; hpsearch reads and writes through none") from None
        if exc.errno == errno.ENXIO:  # a FIFO opened to write with no reader; a device without its driver
            raise NotRegularFile(errno.ENXIO, f"{path} is not a regular file (a FIFO or a device)") from None
        raise
    try:
        found = os.fstat(fd).st_mode
        if not stat.S_ISREG(found):
            raise NotRegularFile(errno.EINVAL, f"{path} is {kind(found)}, not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: Path, how: str = "rb", mode: int = 0o600, *, follow: bool = False, **kwargs: Any) -> IO[Any]:
    """:func:`open_fd` as a file object: ``how`` is ``"r"``/``"rb"`` to read, ``"a"`` to append (created with
    ``mode``, less the umask, if absent)."""
    flags = os.O_RDONLY if how.startswith("r") else os.O_WRONLY | os.O_APPEND | os.O_CREAT
    return os.fdopen(open_fd(path, flags, mode, follow=follow), how, **kwargs)


def read_bytes(path: Path, limit: int, *, follow: bool = False) -> bytes:
    """The whole of ``path`` (checked as :func:`open_fd` does), refused (NotRegularFile) when over ``limit`` bytes:
    a record or index of ours is small, and a planted one must not fill the memory."""
    with open_file(path, "rb", follow=follow) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise NotRegularFile(errno.EFBIG, f"{path} holds {max(size, len(data)):,} bytes, more than {limit:,}")
    return data


def read_text(path: Path, limit: int, *, follow: bool = False, encoding: str = "utf-8") -> str:
    return read_bytes(path, limit, follow=follow).decode(encoding)


def create_new(path: Path, mode: int, *, binary: bool = False) -> IO[Any]:
    """A new file to write at ``path`` (none may be there: a temporary name of the caller's), created with
    ``mode`` (less the umask) rather than the umask's default: for what holds data-derived content. Text (UTF-8)
    unless ``binary``."""
    check_unmoved(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    return os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")


def remove(path: Path) -> bool:
    """Delete ``path`` (a file, or a folder and all it holds) with every folder on the way to it opened without
    following a link, one relative to the other: a folder swapped for a link between a caller's checks and this
    deletion (the output folder, a study or trial folder) stops it, rather than taking it into the link's target.
    True if something was deleted; links met inside a deleted folder are unlinked, not followed (``shutil.rmtree``
    with ``dir_fd`` is the descriptor-based walk)."""
    import shutil

    *folders, name = Path(os.path.abspath(path)).parts
    at = os.open(folders[0], os.O_RDONLY | os.O_DIRECTORY)
    try:
        for folder in folders[1:]:
            try:
                inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=at)
            except OSError:
                return False  # a link (ELOOP / ENOTDIR) or gone: nothing is deleted through it
            os.close(at)
            at = inner
        try:
            mode = os.stat(name, dir_fd=at, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(mode):
            shutil.rmtree(name, ignore_errors=True, dir_fd=at)
        else:
            os.unlink(name, dir_fd=at)
        return True
    finally:
        os.close(at)
