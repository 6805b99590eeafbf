"""Metrics streams: the JSONL records of one process (`trainer`, `sampler-0`, ...) in `metrics/`.

A stream is made of these objects, read in this order:

    metrics/<stream>.jsonl               the start of the stream (on local disk, all of it)
    metrics/<stream>/base-<seq>.jsonl    a rewrite: every record before it; replaces the file above
                                         and every object of a lower <seq>
    metrics/<stream>/chunk-<seq>.jsonl   the records of the parts before it and after the chunk or
                                         base before it; replaces those parts
    metrics/<stream>/part-<seq>.jsonl    the records of one flush, created once, never rewritten

Reading: the newest base (or, when there is none, `<stream>.jsonl`), then the chunks and the parts
numbered after it, by <seq> (8 digits), less the parts a chunk replaces (those below the newest
chunk). Writing: on local disk a record is appended to `<stream>.jsonl` at once; object stores
cannot append, so the writer batches records and puts each batch as a new part (a stream that
already has parts, e.g. a run directory copied off an object store, goes on with parts everywhere).
Every `compact_every` parts the writer folds them into a chunk, and every `compact_every` chunks
the whole stream into a new base, deleting what each replaces: a reader gets at most about twice
`compact_every` objects, and the whole stream is rewritten once every `compact_every`^2 parts, not
every `compact_every` (a long run's stream: tens of MB uploaded, on the writer's thread, every few
minutes), besides `replace` (a resumed trainer dropping the steps it redoes).
"""

from __future__ import annotations

import json
import os
import re
import time

from .rundir import MARKER_NAME_CHARS
from .storage import delete, is_local, list_names, put_atomic, put_if_absent, read_bytes

OBJECT_RE = re.compile(r"^(base|chunk|part)-(\d{8})\.jsonl$")
READ_ATTEMPTS = 3


def _check_name(stream: str) -> str:
    if not stream or not set(stream) <= MARKER_NAME_CHARS or stream.endswith(".jsonl"):
        raise ValueError(f"metrics stream {stream!r}: use lowercase letters, digits, '_', '.', '-'")
    return stream


def _objects(run, stream: str) -> list[tuple[str, int]]:
    """(kind, seq) of the objects in the stream's folder, by seq."""
    found = [OBJECT_RE.match(n) for n in list_names(run.fs, run.path("metrics", stream))]
    return sorted(((m.group(1), int(m.group(2))) for m in found if m), key=lambda o: o[1])


def _live(objects: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The objects a reader reads: from the newest base on (all of them when there is none), less
    the parts below the newest chunk (it holds their records)."""
    bases = [i for i, (kind, _) in enumerate(objects) if kind == "base"]
    live = objects[bases[-1]:] if bases else objects
    folded = max((seq for kind, seq in live if kind == "chunk"), default=-1)
    return [(kind, seq) for kind, seq in live if kind != "part" or seq > folded]


def _parse(raw: bytes, out: list[dict]) -> None:
    """The records of `raw`. A line that is not a record is skipped: the last one may be being
    appended right now (local disk), and one cut by a machine crash is followed by what the
    restarted writer appended."""
    for line in raw.decode(errors="replace").split("\n"):
        try:
            rec = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)


def stream_names(run) -> list[str]:
    """The streams of a run: a `<stream>.jsonl` file, a `<stream>/` folder of parts, or both."""
    names = set()
    for n in list_names(run.fs, run.path("metrics")):
        stem = n[: -len(".jsonl")] if n.endswith(".jsonl") else n
        if stem and set(stem) <= MARKER_NAME_CHARS:
            names.add(stem)
    return sorted(names)


def read_stream(run, stream: str) -> list[dict]:
    """Every record of the stream, in the order logged ([] when it does not exist)."""
    return StreamReader(run, stream).read()


class StreamReader:
    """Reads one stream again and again (a progress line, a watch), fetching only what is new.
    Parts and bases are created once and never rewritten, so each is fetched once; so is
    `<stream>.jsonl` on an object store, where writers never write it (a rebase deletes it). A
    read lists the stream's folder and fetches what it has not read yet. On local disk
    `<stream>.jsonl` is appended to: a read parses only the lines appended since the last one
    (`replace` writes a new file in its place, which is then read from its start)."""

    def __init__(self, run, stream: str):
        self.run, self.stream = run, stream
        self._head = run.path(f"metrics/{stream}.jsonl")
        self._keep_head = not is_local(run.fs)
        self._read: dict[str, list[dict]] = {}  # path -> its records
        self._at: tuple | None = None  # local head: (device, inode, bytes parsed, the last of them)

    def _read_local_head(self) -> list[dict]:
        """The local `<stream>.jsonl`'s records, parsing only the whole lines added since the last
        read. Another file in its place (`replace`; a freed inode number is soon reused) is told by
        its inode, its size or the bytes before where the last read ended, and read from its start."""
        with open(self._head, "rb") as f:
            st = os.fstat(f.fileno())
            dev, ino, done, tail = self._at if self._at is not None else (None, None, 0, b"")
            out = self._read.get(self._head)
            if (dev, ino) != (st.st_dev, st.st_ino) or st.st_size < done or out is None or \
                    (f.seek(done - len(tail)), f.read(len(tail)))[1] != tail:
                done, out, tail = 0, [], b""
            f.seek(done)
            raw = f.read()
        end = raw.rfind(b"\n") + 1  # a last line without its newline may be being appended: next time
        _parse(raw[:end], out)
        self._at = (st.st_dev, st.st_ino, done + end, (tail + raw[:end])[-256:])
        return out

    def read(self) -> list[dict]:
        """Every record of the stream, in the order logged ([] when it does not exist)."""
        for attempt in range(READ_ATTEMPTS):
            try:
                return self._records()
            except FileNotFoundError:  # a compaction deleted an object after the listing: list again
                if attempt + 1 == READ_ATTEMPTS:
                    raise
        return []

    def _records(self) -> list[dict]:
        run, stream = self.run, self.stream
        live = _live(_objects(run, stream))
        paths = [run.path("metrics", stream, f"{kind}-{seq:08d}.jsonl") for kind, seq in live]
        if not live or live[0][0] != "base":
            paths.insert(0, self._head)
            if self._head not in self._read or not self._keep_head:
                out: list[dict] = []
                try:
                    if self._keep_head:
                        _parse(read_bytes(run.fs, self._head), out)
                    else:
                        out = self._read_local_head()
                except FileNotFoundError:
                    self._at = None  # a stream written in parts only
                self._read[self._head] = out
        new = [p for p in paths if p not in self._read]
        blobs = run.fs.cat(new, on_error="raise") if new else {}
        for path in new:
            self._read[path] = out = []
            _parse(blobs[path] if path in blobs else blobs[run.fs._strip_protocol(path)], out)
        self._read = {p: self._read[p] for p in paths}  # what a rebase replaced is dropped
        return [r for p in paths for r in self._read[p]]


class NullMetrics:
    """Metrics of trainer ranks other than 0: `MetricsLog`'s writing methods, no output."""

    def log(self, record: dict) -> None:
        pass

    def flush(self) -> None:
        pass


def _end_cut_line(path: str) -> None:
    """A writer killed mid-line (a machine crash) left the file's last line without its newline:
    end it, so that the next record starts a line of its own."""
    try:
        with open(path, "rb+") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    except FileNotFoundError:
        pass


class MetricsLog:
    """The writer of one stream (one process per stream). Local disk: appended and flushed per
    record. Object stores: a new part every `flush_every` records or `flush_s` seconds, whichever
    comes first (checked when a record is logged; `flush` writes what is pending), and a base
    every `compact_every` parts."""

    def __init__(self, run, stream: str, flush_every: int = 100, flush_s: float = 5.0, compact_every: int = 50):
        self.run, self.fs, self.stream = run, run.fs, _check_name(stream)
        self.file = run.path(f"metrics/{stream}.jsonl")
        self.flush_every, self.flush_s, self.compact_every = flush_every, flush_s, compact_every
        objects = _objects(run, stream)
        self._parts = not is_local(self.fs) or bool(objects)
        self._seq = objects[-1][1] + 1 if objects else 0
        self._unfolded = len([o for o in _live(objects) if o[0] == "part"])  # parts no chunk holds yet
        self._pending: list[str] = []
        self._flushed_at = time.monotonic()
        if not self._parts:
            self.fs.makedirs(run.path("metrics"), exist_ok=True)
            _end_cut_line(self.file)

    def log(self, record: dict) -> None:
        line = json.dumps({"time": time.time(), **record})
        if not self._parts:
            with open(self.file, "a") as f:
                f.write(line + "\n")
            return
        self._pending.append(line)
        if len(self._pending) >= self.flush_every or time.monotonic() - self._flushed_at >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        """Write the pending records as one new part (object stores; nothing to do on local disk)."""
        self._flushed_at = time.monotonic()
        if not self._pending:
            return
        self._create("part", ("\n".join(self._pending) + "\n").encode())
        self._pending = []
        self._unfolded += 1
        if self._unfolded >= self.compact_every:
            self._fold()

    def _fold(self) -> None:
        """The live parts into one chunk, or, once there are `compact_every` chunks, the whole stream
        into a base."""
        live = _live(_objects(self.run, self.stream))
        if sum(kind == "chunk" for kind, _ in live) >= self.compact_every:
            self._rebase([json.dumps(r) for r in read_stream(self.run, self.stream)])
            return
        paths = [self.run.path("metrics", self.stream, f"part-{seq:08d}.jsonl") for kind, seq in live if kind == "part"]
        self._unfolded = 0
        if not paths:
            return
        blobs = self.fs.cat(paths, on_error="raise")
        data = [blobs[p] if p in blobs else blobs[self.fs._strip_protocol(p)] for p in paths]
        self._create("chunk", b"".join(d if d.endswith(b"\n") else d + b"\n" for d in data if d))
        for path in paths:  # a reader that listed them before the chunk lists again when one is gone
            delete(self.fs, path)

    def replace(self, records: list[dict]) -> None:
        """Make `records` the whole stream (a resumed trainer drops the records of the steps it redoes)."""
        lines = [json.dumps(r) for r in records]
        self._pending = []
        if not self._parts:
            put_atomic(self.fs, self.file, "".join(x + "\n" for x in lines).encode())
        else:
            self._rebase(lines)

    def _create(self, kind: str, data: bytes) -> int:
        while not put_if_absent(self.fs, self.run.path("metrics", self.stream, f"{kind}-{self._seq:08d}.jsonl"),
                                data, fsync=False):
            self._seq += 1  # taken (a writer that did not list it yet): the next number
        self._seq += 1
        return self._seq - 1

    def _rebase(self, lines: list[str]) -> None:
        """Publish `lines` as a base, then delete the objects it replaces (readers that listed them
        before the base appeared list again when one is gone)."""
        seq = self._create("base", "".join(x + "\n" for x in lines).encode())
        self._unfolded = 0
        for kind, old in _objects(self.run, self.stream):
            if old < seq:
                delete(self.fs, self.run.path("metrics", self.stream, f"{kind}-{old:08d}.jsonl"))
        delete(self.fs, self.file)
