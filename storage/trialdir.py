"""A trial's folder, ``OUTPUT/STUDY/trial-N``, and the one rule for every path that reaches us.

A path read from a study's rows or a shared runs folder is input, not an instruction: hpsearch deletes, moves or
loads only what lies inside a trial folder of the study folder it made (rundir.py), links resolved; a link to
elsewhere is refused and logged. Trial N's files are known without asking anybody, so a recorded path is at most
a hint (docs/decisions.md, "A path from a row is a hint").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from hpsearch.storage import regular

log = logging.getLogger(__name__)

PREFIX = "trial-"
BEST = "best"
RESUME = "resume"
RESUME_FILE = "state.pt"
# Beside it: the micro-batch a rank of a multi-device trial ran out of memory at, for the group's restart to read.
OUT_OF_MEMORY_FILE = "out_of_memory.json"
CURVES = "tensorboard"
LOG = "train.log"  # the log of every attempt at the trial (search/workers/worker.py writes it)
_LOCK = ".hpsearch.lock"  # held shared by an export while it copies best/, exclusively by retention to delete it


class TrialDirError(OSError):
    """A trial's folder is not one hpsearch may write through (a link, or a file in its place)."""


@dataclass(frozen=True)
class TrialDir:
    root: Path  # the study's folder on this host, OUTPUT/STUDY
    number: int

    @property
    def path(self) -> Path:
        return self.root / f"{PREFIX}{self.number}"

    @property
    def best(self) -> Path:
        return self.path / BEST

    @property
    def resume(self) -> Path:
        return self.path / RESUME

    @property
    def state(self) -> Path:
        return self.resume / RESUME_FILE

    @property
    def out_of_memory(self) -> Path:
        return self.resume / OUT_OF_MEMORY_FILE

    @property
    def log(self) -> Path:
        return self.path / LOG

    @property
    def curves(self) -> Path:
        """The TensorBoard event files of every attempt at the trial."""
        return self.path / CURVES

    @classmethod
    def named(cls, root: Path, folder_name: str) -> TrialDir | None:
        """The trial folder a directory entry of ``root`` names (``trial-12``), or None."""
        number = folder_name.removeprefix(PREFIX)
        return cls(root, int(number)) if folder_name.startswith(PREFIX) and number.isdigit() else None

    def make(self) -> Path:
        """Create the folder (or find it) for this trial to write in; refuse one that is a link, or in one (or in an
        output folder swapped for a link since it was resolved at start)."""
        if not self.root.is_symlink() and regular.unmoved(self.path):  # else nothing is made through it: refused
            self.root.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # a file or a dangling link in its place: refused below
                self.path.mkdir(exist_ok=True)
        if not self.is_real():
            raise TrialDirError(
                errno.EPERM,
                f"{self.path} is not a folder of {self.root} (a link or a file put in its place); "
                "hpsearch never writes through one: remove it",
            )
        return self.path

    def is_real(self) -> bool:
        """Whether the folder is a plain directory of ``root``, and ``root`` one of its parent (neither is a link to
        elsewhere: a study folder made a link would take retention's deletions out of the runs folder), reached
        through no link: ``root`` is the output folder as resolved at start, and one swapped for a link since (the
        output folder itself, or a folder above) is refused (storage/regular.py ``unmoved``)."""
        try:
            links = self.root.is_symlink() or self.path.is_symlink() or not regular.unmoved(self.path)
            return not links and self.path.is_dir() and self.path.resolve() == self._real()
        except OSError:
            return False

    def open_log(self) -> TextIO:
        """The trial's ``train.log``, opened to append; a link, FIFO, socket or device in its place is replaced
        (with a warning), never written through nor waited on."""
        self.unlink_link(self.log)
        # Put there after the check: refused (storage/regular.py), not followed, and the open does not block.
        return regular.open_file(self.log, "a", 0o644, encoding="utf-8")

    def unlink_link(self, path: Path) -> None:
        """Take away a link someone put where this trial writes a file or folder of its own (its log, its curves),
        or a FIFO, socket or device (opening one would hang, or write to the device). Only inside this trial's own
        folder, reached through no link."""
        try:
            mode = path.lstat().st_mode
        except OSError:
            return  # nothing there
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or not self.is_real():
            return
        what = f"a link (to {os.readlink(path)})" if stat.S_ISLNK(mode) else regular.kind(mode)
        log.warning("replacing %s: it is %s, and hpsearch writes only regular files, through no link", path, what)
        path.unlink()

    def holds(self, path: Path) -> bool:
        """Whether ``path`` lies inside this trial's folder once every link is resolved, and is no link itself.
        Refusals are logged: someone put that path there."""
        inside = False
        with contextlib.suppress(OSError):
            inside = self.is_real() and not path.is_symlink() and path.resolve().is_relative_to(self._real())
        if not inside and (path.exists() or path.is_symlink()):
            log.warning(
                "refusing %s: it does not lie inside %s (a study row or a shared folder named it); left untouched",
                path,
                self.path,
            )
        return inside

    def remove(self, path: Path) -> bool:
        """Delete ``path`` (a folder or file of this trial) if :meth:`holds` it; True if it went."""
        if not (path.exists() or path.is_symlink()) or not self.holds(path):
            return False
        # Checked above, deleted here: a folder on the way swapped for a link in between stops the deletion.
        regular.remove(path)
        return not path.exists()

    def move(self, name: str, to: TrialDir) -> bool:
        """Move this trial's ``best`` or ``resume`` into ``to`` (whose own is replaced)."""
        source, target = self.path / name, to.path / name
        if not source.exists() or not self.holds(source):
            return False
        to.make()
        to.remove(target)
        shutil.move(source, target)
        return True

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the trial's best model against retention while it is copied (an export)."""
        with self._locked(fcntl.LOCK_SH) as held:
            if not held:
                raise TrialDirError(errno.EBUSY, f"cannot lock {self.path}")
            yield

    @contextlib.contextmanager
    def deleting(self) -> Iterator[bool]:
        """Whether the best model may be deleted now: False while an export is reading it."""
        with self._locked(fcntl.LOCK_EX | fcntl.LOCK_NB) as held:
            yield held

    @contextlib.contextmanager
    def _locked(self, how: int) -> Iterator[bool]:
        if not self.is_real():
            yield False
            return
        try:
            # A lock file replaced by a link is not opened (nor created) through it; a FIFO is not waited on.
            fd = regular.open_fd(self.path / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            yield False
            return
        try:
            try:
                fcntl.flock(fd, how)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock

    def _real(self) -> Path:
        return self.root.resolve() / self.path.name


def named_by(root: Path, path: Path, name: str) -> TrialDir | None:
    """The trial folder under ``root`` whose ``name`` (``best``, ``resume``) ``path`` (read from a row) is, after
    resolving links, or None."""
    try:
        real = path.resolve()
    except OSError:
        return None
    folder = TrialDir.named(root, real.parent.name) if real.name == name else None
    return folder if folder is not None and real.parent.parent == root.resolve() and folder.holds(path) else None
