"""Reading run storage that can fail for a moment or stall: transient errors retried, damage told apart,
every wait bounded.

Shared filesystems have bad moments: an NFS server that restarts (``ESTALE``, ``EIO``, ``ETIMEDOUT``), a
Lustre client that reconnects, an object store that answers 503. Such an error is not damage, and taking
it for damage would pass over a whole checkpoint (and rewrite Ray Train's index to skip it). So reads of
checkpoints, manifests and indexes go through ``retried``: a file that is not there, or whose content
does not parse, is for the caller to judge (missing, damaged); a permission error is the user's to fix;
anything else is *transient*, tried again a few times with a back-off, and then a ``StorageError`` (one
line, what to do) with nothing changed. ``bounded`` gives up on a call during which storage has not answered for
``RAYTRAIN_STORAGE_TIMEOUT`` (a stalled mount) with a ``StorageError``: a long read that goes on answering
(``answered``, per chunk: checking a large checkpoint's CRCs) is not a stall. The stuck call is left behind
in a daemon thread, and the process can still say so and exit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from raytrain.contracts import env
from raytrain.errors import UserError
from raytrain.uri import first_line

T = TypeVar("T")
BACKOFF_S = (0.5, 1.0, 2.0)  # between the tries of a read that met a transient error
_answers = [time.monotonic()]  # when storage last answered a read that ticks ``answered`` (any thread)


def answered() -> None:
    """Storage has just answered (a chunk of a long read came in): a ``bounded`` call is not stalled."""
    _answers[0] = time.monotonic()


class StorageError(UserError):
    """The run's storage failed or stalled: what was being done, and what to do."""


def transient(exc: BaseException) -> bool:
    """Whether an error may go away by itself: an OSError that is not 'not there', 'not allowed' or a
    wrong kind of file."""
    lasting = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)
    return isinstance(exc, OSError) and not isinstance(exc, lasting)


def retried(call: Callable[[], T], what: str) -> T:
    """``call()``, tried again after a transient error (``BACKOFF_S``); a StorageError naming WHAT once the
    tries are spent, or at once for a permission error. Any other error is the caller's."""
    for pause in (*BACKOFF_S, None):
        try:
            return call()
        except PermissionError as exc:
            raise StorageError(
                f"cannot read {what}: permission denied ({first_line(exc)}): check who owns it"
            ) from None
        except OSError as exc:
            if not transient(exc):
                raise
            if pause is None:
                raise StorageError(
                    f"storage kept failing while reading {what} ({first_line(exc)}, {len(BACKOFF_S) + 1} tries): "
                    "nothing was changed; run again once the storage answers"
                ) from None
            time.sleep(pause)
    raise AssertionError("unreachable")


def bounded(call: Callable[[], T], what: str, timeout_s: float | None = None, *, writes: bool = False) -> T:
    """``call()``, or a StorageError if storage has not answered for ``timeout_s`` (default
    ``RAYTRAIN_STORAGE_TIMEOUT``) while it runs: the call returning, or a chunk of a long read
    (``answered``), is an answer. An OSError it raises becomes a StorageError that names WHAT; other
    errors are raised as they are. ``writes``: the call changes storage, so the error cannot say that
    nothing changed (a stalled write left running may still take effect once the storage answers)."""
    limit = env.STORAGE_TIMEOUT.value() if timeout_s is None else timeout_s
    changed = "it may still take effect once the storage answers" if writes else "nothing was changed"
    done = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc
        finally:
            done.set()

    started = time.monotonic()

    def quiet() -> float:  # seconds since storage last answered
        return time.monotonic() - max(started, _answers[0])

    threading.Thread(target=run, name="raytrain-storage", daemon=True).start()
    while not done.wait(max(0.0, limit - quiet())):
        if quiet() < limit:
            continue  # a chunk of a long read came in meanwhile
        raise StorageError(
            f"storage did not answer within {limit:.0f} s while {what}: a stalled mount? {changed}; "
            f"check it (ls, df), then run again (or raise {env.STORAGE_TIMEOUT.name})"
        )
    error = box.get("error")
    if isinstance(error, OSError):  # not a StorageError (a UserError): storage failing in a way not retried
        raise StorageError(
            f"storage failed while {what} ({first_line(error)}): "
            f"{'it may be partly done' if writes else 'nothing was changed'}; check it, then run again"
        ) from None
    if isinstance(error, BaseException):
        raise error
    return box["value"]  # type: ignore[return-value]
