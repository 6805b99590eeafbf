"""The commit log's files: their names, their checksum seal and the format check every reader makes.

    _log/00000000000000000042.json        entry 42 (see actions.LogEntry)
    _log/00000000000000000050.ckpt.json   the state after entry 50
    _log/_last_checkpoint                  {"v": 50}
    _log/_tip                              {"v": 57, "by": "<appender id>"}

Every entry and checkpoint starts with `"sum"`, a checksum of the rest of its bytes, so a file
changed after it was written is detected on reading; files written before it existed have none and
are read as they are. The rest of the file is plain JSON: `json.loads` reads any of them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable, Sequence

import xxhash

if TYPE_CHECKING:
    from .state import BufferState

LOG_DIR = "_log"
POINTER = "_last_checkpoint"
TIP = "_tip"
LOG_FORMAT = 1

_SUM_HEAD = b'{"sum": "'  # a sealed file: {"sum": "<16 hex digits>", <the document's other keys>}
_SUM_LEN = 16


class CorruptLog(ValueError):
    """The buffer's state cannot be rebuilt from its commit log; the message names the file."""


class UnsupportedLogFormat(RuntimeError):
    """A commit-log file written by a newer rlhf-pipeline; the message names the file."""


class CommitConflict(RuntimeError):
    """A commit whose precondition no longer holds after another process committed first."""


def shards_still_live(paths: Sequence[str], what: str = "shards") -> Callable[["BufferState"], None]:
    """Commit precondition: every shard about to be removed is still live."""

    def check(st: "BufferState") -> None:
        gone = [p for p in paths if p not in st.shards]
        if gone:
            raise CommitConflict(f"{what} already removed by another process: {gone[:3]}")

    return check


def entry_name(version: int) -> str:
    return f"{version:020d}.json"


def checkpoint_name(version: int) -> str:
    return f"{version:020d}.ckpt.json"


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _checksum(body: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(body)


def seal(doc: dict) -> bytes:
    """A log file's bytes: the JSON document with a checksum of its serialisation as first key."""
    body = json.dumps(doc).encode()
    return _SUM_HEAD + _checksum(body).encode() + b'", ' + body[1:]


def unseal(raw: bytes) -> dict:
    """The document of a log file, without its checksum. ValueError when the bytes are not a JSON
    object (torn), or when a checksum is there and does not match (changed after writing)."""
    try:
        doc = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise ValueError(f"torn: not JSON, {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"torn: a JSON {type(doc).__name__}, not an object")
    if "sum" in doc:
        head, n = len(_SUM_HEAD), len(_SUM_HEAD) + _SUM_LEN
        body = b"{" + raw[n + 3:]
        if raw[:head] != _SUM_HEAD or raw[n:n + 3] != b'", ' or raw[head:n] != _checksum(body).encode():
            raise ValueError("changed: its checksum does not match, the file was changed after it was written")
        del doc["sum"]
    return doc


def check_format(doc: dict, path: str) -> None:
    """UnsupportedLogFormat for a newer format; ValueError for a format that is not a number."""
    fmt = doc.get("format", 1)
    if not is_int(fmt):
        raise ValueError(f"malformed: 'format' is {str(fmt)[:40]!r}, not a number")
    if fmt > LOG_FORMAT:
        raise UnsupportedLogFormat(
            f"buffer log {path}: log format v{fmt}, this installation reads up to "
            f"v{LOG_FORMAT}; upgrade rlhf-pipeline to read this buffer"
        )


def unusable(what: str, e: Exception) -> str:
    """'torn commit-log entry (not JSON ...)' from ValueError('torn: not JSON ...'); other errors
    (a checkpoint's missing key, wrong type) make the file malformed."""
    kind, sep, detail = str(e).partition(": ")
    if isinstance(e, ValueError) and sep and kind in ("torn", "changed", "misplaced", "malformed"):
        return f"{kind} {what} ({detail})"
    return f"malformed {what} ({type(e).__name__}: {e})"
