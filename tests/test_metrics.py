"""Metrics streams: appends on object stores write small new parts, never the whole stream per record."""

import json
import sys
import uuid
from pathlib import Path

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from pipeline.metrics import MetricsLog
from pipeline.rundir import RunDir


@pytest.fixture
def puts(monkeypatch):
    """Bytes of every object written to memory://, in order."""
    out: list[bytes] = []
    real = MemoryFileSystem.pipe_file

    def recording(self, path, value, **kw):
        out.append(value)
        return real(self, path, value, **kw)

    monkeypatch.setattr(MemoryFileSystem, "pipe_file", recording)
    return out


def _memory_run() -> RunDir:
    return RunDir(f"memory://metrics-test-{uuid.uuid4().hex}/run-1")


def test_records_on_an_object_store_go_to_new_parts_not_a_rewrite_per_record(puts):
    run = _memory_run()
    log = MetricsLog(run, "trainer", flush_every=10, flush_s=1e9, compact_every=1000)
    for step in range(1, 201):
        log.log({"step": step, "reward/mean": 0.5})
    log.flush()
    stream = sum(len(b) for b in puts)
    assert len(puts) == 20  # one object per flush of 10 records
    assert max(len(b) for b in puts) < stream / 10  # each holds one batch, not the stream so far
    assert [r["step"] for r in run.read_metrics("trainer")] == list(range(1, 201))
    assert run.metric_streams() == ["trainer"]


def test_compaction_bounds_the_objects_a_reader_gets_and_rewrites_rarely(puts):
    run = _memory_run()
    log = MetricsLog(run, "sampler-0", flush_every=1, flush_s=1e9, compact_every=25)
    for i in range(100):
        log.log({"sampler/batch": i})
    final = len(json.dumps(run.read_metrics("sampler-0")))
    assert sum(len(b) for b in puts) < 5 * final  # a rewrite per 25 records: 3.5x the stream, not 50x
    assert len(run.fs.ls(run.path("metrics", "sampler-0"))) <= 25
    assert [r["sampler/batch"] for r in run.read_metrics("sampler-0")] == list(range(100))


def test_parts_fold_into_chunks_and_the_whole_stream_is_rewritten_only_every_compact_every_chunks(puts):
    """Before, every `compact_every` parts rewrote the whole stream: on a long run on an object
    store, tens of MB read and uploaded on the writer's thread every few minutes (O(n^2) in all)."""
    from pipeline.metrics import StreamReader, _live, _objects

    run = _memory_run()
    log = MetricsLog(run, "trainer", flush_every=1, flush_s=1e9, compact_every=5)
    reader = StreamReader(run, "trainer")  # reads all along, as a progress watch does
    for step in range(1, 301):
        log.log({"step": step, "reward/mean": 0.5})
        if step % 7 == 0:
            assert [r["step"] for r in reader.read()] == list(range(1, step + 1))
        live = _live(_objects(run, "trainer"))
        assert len(live) <= 2 * 5 and [k for k, _ in live].count("base") <= 1
    final = len(json.dumps(run.read_metrics("trainer")))
    written = sum(len(b) for b in puts)
    assert written < 8 * final, written / final  # parts, chunks and a base every 25 parts: ~6x; before ~30x
    assert [r["step"] for r in run.read_metrics("trainer")] == list(range(1, 301))
    assert [r["step"] for r in reader.read()] == list(range(1, 301))
    restarted = MetricsLog(run, "trainer", flush_every=1, flush_s=1e9, compact_every=5)  # unfolded parts left
    for step in range(301, 311):
        restarted.log({"step": step})
    assert [r["step"] for r in run.read_metrics("trainer")] == list(range(1, 311))
    assert len(_live(_objects(run, "trainer"))) <= 2 * 5


def test_old_single_file_streams_and_new_parts_read_in_order_and_replace_drops_records():
    run = _memory_run()
    run.fs.pipe_file(run.path("metrics", "trainer.jsonl"), b'{"step": 1}\n{"step": 2}\n')  # written before parts
    log = MetricsLog(run, "trainer", flush_every=1, flush_s=1e9)
    log.log({"step": 3})
    resumed = MetricsLog(run, "trainer", flush_every=1, flush_s=1e9)  # a restarted process numbers on
    resumed.log({"step": 4})
    assert [r["step"] for r in run.read_metrics("trainer")] == [1, 2, 3, 4]
    resumed.replace([r for r in run.read_metrics("trainer") if r["step"] <= 2])  # a resumed trainer's rollback
    resumed.log({"step": 3})
    resumed.flush()
    assert [r["step"] for r in run.read_metrics("trainer")] == [1, 2, 3]
    assert not run.fs.exists(run.path("metrics", "trainer.jsonl"))  # folded into the base


def test_local_streams_append_to_one_file_readable_at_once(tmp_path):
    run = RunDir(str(tmp_path / "run-1"))
    log = run.metrics("trainer")
    log.log({"step": 1})
    assert [r["step"] for r in run.read_metrics("trainer")] == [1]  # no flush needed on local disk
    log.replace([])
    log.log({"step": 2})
    assert (tmp_path / "run-1" / "metrics" / "trainer.jsonl").read_text().count("\n") == 1
    assert run.metric_streams() == ["trainer"]


@pytest.mark.integration
def test_parts_on_a_real_s3_endpoint():
    sys.path.insert(0, str(Path(__file__).parent / "buffer"))
    from s3_endpoint import moto_s3, new_prefix

    with moto_s3("metrics-test") as bucket:
        run = RunDir(f"{new_prefix(bucket)}/run-1")
        log = run.metrics("trainer")
        for step in range(1, 51):
            log.log({"step": step})
        log.flush()
        assert [r["step"] for r in run.read_metrics("trainer")] == list(range(1, 51))
        assert len(run.fs.ls(run.path("metrics", "trainer"))) == 1  # 50 records, one flush: one part
        assert run.metric_streams() == ["trainer"]


def test_a_reader_that_reads_again_fetches_only_the_objects_that_are_new(monkeypatch):
    """A progress watch reads the trainer's stream every second: before, every look fetched every
    part (and looked for `<stream>.jsonl` again)."""
    from pipeline.metrics import StreamReader

    fetched: list[str] = []
    real = MemoryFileSystem.cat_file

    def counting(self, path, *a, **k):
        fetched.append(path.rsplit("/", 1)[-1])
        return real(self, path, *a, **k)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", counting)
    run = _memory_run()
    log = MetricsLog(run, "trainer", flush_every=1, flush_s=1e9, compact_every=4)
    reader = StreamReader(run, "trainer")
    for step in range(1, 11):
        log.log({"step": step})
        fetched.clear()
        assert [r["step"] for r in reader.read()] == list(range(1, step + 1))
        # the new part or base (and, the first time, the stream's first file, absent here)
        assert fetched == (["trainer.jsonl"] if step == 1 else []) + [fetched[-1]], fetched
    log.replace([{"step": 1}])  # a resumed trainer drops the steps it redoes
    assert [r["step"] for r in reader.read()] == [1]


def test_a_line_cut_by_a_crash_hides_nothing_the_restarted_writer_appends(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    first = MetricsLog(run, "sampler-0")
    first.log({"step": 1})
    with open(first.file, "a") as f:
        f.write('{"step": 2, "rew')  # the machine went down in the middle of this record
    again = MetricsLog(run, "sampler-0")  # the restarted sampler
    again.log({"step": 3})
    again.log({"step": 4})
    assert [r["step"] for r in run.read_metrics("sampler-0")] == [1, 3, 4]
    with open(first.file, "a") as f:
        f.write('{"step": 5, "rew')  # being appended as it is read
    assert [r["step"] for r in run.read_metrics("sampler-0")] == [1, 3, 4]


def test_a_local_reader_parses_only_the_lines_appended_since_its_last_read(tmp_path, monkeypatch):
    """`rlhf run` and the trainer's Airflow task read the trainer's stream every second or five:
    each read parsed the whole file, 0.5 s a read at 30k steps."""
    from pipeline import metrics
    from pipeline.metrics import StreamReader

    parsed: list[int] = []
    real = metrics._parse
    monkeypatch.setattr(metrics, "_parse", lambda raw, out: (parsed.append(len(raw)), real(raw, out)))
    run = RunDir(str(tmp_path / "run"))
    log = MetricsLog(run, "trainer")
    reader = StreamReader(run, "trainer")
    for step in range(1, 101):
        log.log({"step": step})
    assert [r["step"] for r in reader.read()] == list(range(1, 101))
    log.log({"step": 101})
    parsed.clear()
    assert [r["step"] for r in reader.read()][-2:] == [100, 101]
    assert parsed == [len(Path(log.file).read_bytes().splitlines(keepends=True)[-1])]  # the new line only
    with open(log.file, "a") as f:
        f.write('{"step": 10')  # being appended as it is read
    assert len(reader.read()) == 101
    with open(log.file, "a") as f:
        f.write('2}\n')
    assert [r["step"] for r in reader.read()][-1] == 102
    log.replace([{"step": 1}, {"step": 2}])  # a resumed trainer drops the steps it redoes
    assert [r["step"] for r in reader.read()] == [1, 2]
    log.log({"step": 3})
    assert [r["step"] for r in reader.read()] == [1, 2, 3]
    log.replace([{"step": 1}])  # twice between two reads: the second file may take the first's inode number
    log.replace([{"step": s, "pad": "y" * 50} for s in range(1, 6)])
    assert [r["step"] for r in reader.read()] == [1, 2, 3, 4, 5]
