"""Which file system a path lives on: SQLite must not run its WAL on a network one (docs/decisions.md, "A SQLite
file on a network file system keeps the rollback journal"; https://sqlite.org/wal.html)."""

from __future__ import annotations

import os
from pathlib import Path

_NETWORK = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "gpfs", "beegfs", "afs"}
_LOCAL_FUSE = {"fuse.fuse-overlayfs"}  # rootless containers' own root: one host's disk


def filesystem(path: Path, mounts: str | None = None) -> str:
    """The type of the file system ``path`` is on (``/proc/mounts``' third column), or "" if unknown."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:  # not Linux
            return ""
    target = os.path.realpath(path)
    best, kind = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def is_network(kind: str) -> bool:
    return kind in _NETWORK or (kind.startswith("fuse.") and kind not in _LOCAL_FUSE) or kind == "fuse"
