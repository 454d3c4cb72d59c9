"""Directories that are one user's alone: made so, and checked before they are trusted.

On a shared cluster another user can create a directory (or a symbolic link) by a name raytrain is about
to use (``/tmp`` is shared by everyone on a node; a scratch filesystem is often writable by all), and
plant what raytrain would then read or run. So a directory raytrain keeps private (a job's token
directory, its logs, Ray's temp dir and caches on a node, a run directory) is opened without following
links, must belong to this user, and is made 0700 through that open descriptor, never by a path that
could be swapped in between.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from raytrain.errors import UserError


def owner(uid: int) -> str:
    """A uid as a user sees it: ``uid 1001 (alice)``."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def problem(path: Path, *, group_ok: int | None = None) -> str | None:
    """Why PATH is not a directory this user may trust (None: it is one): a link, not a directory,
    another user's, or writable by others (``group_ok``: a group that may share it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    mode = stat.S_IMODE(st.st_mode)
    shared = group_ok is not None and st.st_gid == group_ok
    if st.st_uid != os.getuid() and not (shared and mode & 0o070 == 0o070):
        return f"belongs to {owner(st.st_uid)}, not to you"
    if mode & 0o002 or (mode & 0o020 and not shared):
        return f"is writable by other users (mode {mode:o})"
    return None


def ensure(path: Path, what: str, fix: str, *, mode: int = 0o700) -> bool:
    """Make PATH (its parent must exist) a directory of this user's with MODE: created if missing, else
    opened without following links, checked, and its mode set through that descriptor. A UserError
    naming WHAT and saying FIX when it is a link, not a directory, or another user's. True if created."""
    created = True
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        created = False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        why = "is a symbolic link" if os.path.islink(path) else f"cannot be opened ({exc.strerror or exc})"
        raise UserError(f"{what} {path} {why}: {fix}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise UserError(f"{what} {path} belongs to {owner(st.st_uid)}, not to you: {fix}")
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return created


def node_caches(tmp_root: Path, fallback: Path) -> dict[str, str]:
    """The environment that keeps torch's and Triton's compile caches on a node in a directory of this
    user's alone: ``<tmp_root>/raytrain-cache-<uid>`` (kept across jobs, so a kernel compiles once), or
    FALLBACK (a job's own private dir) when someone else holds that name."""
    from raytrain.contracts import env

    base = tmp_root / f"raytrain-cache-{os.getuid()}"
    try:
        ensure(base, "the compile cache", "")
    except (UserError, OSError):
        base = fallback
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return {env.INDUCTOR_CACHE.name: str(base / "torchinductor"), env.TRITON_CACHE.name: str(base / "triton")}
