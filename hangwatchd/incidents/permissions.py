"""Who may read an incident: root, and the one user whose processes it holds.

An incident holds stacks, environments and GPU memory of the processes it
captured. Its directory stays root's (the daemon later prunes and uploads it;
a user who owned it could plant links there) and closed to everyone (0700,
files 0600); when every process in it runs as the same ordinary user, a POSIX
ACL gives that user read access (``hangwatchd incidents``/``show`` as that user
work for their own incidents). An incident of mixed users, or of root, stays
root's alone. Where the filesystem has no ACLs it stays root's alone, and the
log says so once.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Iterable
from pathlib import Path

import structlog

log = structlog.get_logger("hangwatchd.incident_access")

XATTR = "system.posix_acl_access"
_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_UNDEFINED = 0xFFFFFFFF
_warned = False


def reader_of(uids: Iterable[int | None]) -> int | None:
    """The one ordinary user who may read an incident of processes running as ``uids``; None: root only."""
    distinct = set(uids)
    if len(distinct) != 1:
        return None
    (uid,) = distinct
    return uid if uid is not None and uid > 0 else None


def acl(owner_perm: int, uid: int, perm: int) -> bytes:
    """The binary form of ``u::owner_perm, u:uid:perm, g::---, m::perm, o::---`` (the kernel's xattr layout)."""
    entries = [(_USER_OBJ, owner_perm, _UNDEFINED), (_USER, perm, uid), (_GROUP_OBJ, 0, _UNDEFINED),
               (_MASK, perm, _UNDEFINED), (_OTHER, 0, _UNDEFINED)]
    return struct.pack("<I", _VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)


def restrict(root: Path, uids: Iterable[int | None]) -> int | None:
    """Close ``root`` (an incident dir) to all but root and its processes' one user; return that user.

    Nothing under it is followed: links are left as they are (the daemon writes none).
    """
    reader = reader_of(uids)
    _apply(root, True, reader)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                _apply(path, stat.S_ISDIR(st.st_mode), reader)
    return reader


def _apply(path: Path, is_dir: bool, reader: int | None) -> None:
    global _warned
    os.chmod(path, 0o700 if is_dir else 0o600, follow_symlinks=False)
    if reader is None:
        return
    try:
        os.setxattr(path, XATTR, acl(7 if is_dir else 6, reader, 5 if is_dir else 4), follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM, errno.EACCES, errno.ENOSPC, errno.EDQUOT):
            raise
        if not _warned:
            _warned = True
            log.warning("incident_acl_not_set", dir=str(path), error=exc.strerror,
                        effect="incidents are readable by root only")
