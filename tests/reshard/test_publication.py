"""Publication: create-only manifest, idempotent re-runs, verification, the policy store, any URL."""

import json
import os
import shutil

import pytest
import torch

from pipeline.reshard import ReshardError, publish, reshard, verify
from pipeline.weights import load_state_dict


def _snapshot(folder):
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, folder)] = (f.read(), os.stat(p).st_mtime_ns)
    return out


def test_rerun_does_no_work_and_a_fresh_run_writes_identical_bytes(trainer_ckpt, tmp_path, monkeypatch):
    out = str(tmp_path / "tp2")
    m1, created = publish(trainer_ckpt, out, "tp:2")
    assert created
    before = _snapshot(out)

    from pipeline.reshard import engine

    def no_stream(*a, **k):
        raise AssertionError("a re-run of a published output must not stream tensors again")

    monkeypatch.setattr(engine, "_stream", no_stream)
    m2, created = publish(trainer_ckpt, out, "tp:2")
    assert not created and m2 == m1 and _snapshot(out) == before
    monkeypatch.undo()

    shutil.rmtree(out)
    reshard(trainer_ckpt, out, to="tp:2")
    assert {k: v[0] for k, v in _snapshot(out).items()} == {k: v[0] for k, v in before.items()}


def test_rerun_over_a_damaged_output_refuses_instead_of_trusting_it(trainer_ckpt, tmp_path):
    out = str(tmp_path / "hf")
    reshard(trainer_ckpt, out, to="hf")
    path = os.path.join(out, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = verify(out)
    assert not report.ok and "model.safetensors xxh3_128" in report.problems[0]
    with pytest.raises(ReshardError, match="does not verify"):
        reshard(trainer_ckpt, out, to="hf")


def test_version_1_outputs_with_sha256_checksums_still_verify_and_are_reused(trainer_ckpt, tmp_path, monkeypatch):
    import hashlib

    out = str(tmp_path / "tp2")
    reshard(trainer_ckpt, out, to="tp:2")
    path = os.path.join(out, "manifest.json")
    m = json.load(open(path))
    for rel, entry in m["files"].items():
        with open(os.path.join(out, rel), "rb") as f:
            m["files"][rel] = {"bytes": entry["bytes"], "sha256": hashlib.sha256(f.read()).hexdigest()}
    m["manifest_version"] = 1
    with open(path, "w") as f:
        json.dump(m, f)
    assert verify(out).ok and verify(out).files == len(m["files"])

    from pipeline.reshard import engine

    def no_stream(*a, **k):
        raise AssertionError("a re-run over a verified output must not stream tensors again")

    monkeypatch.setattr(engine, "_stream", no_stream)
    again, created = publish(trainer_ckpt, out, "tp:2")
    assert not created and again == m
    monkeypatch.undo()

    rank0 = os.path.join(out, m["rank_files"][0])
    with open(rank0, "r+b") as f:
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    report = verify(out)
    assert [p.split(" ")[:2] for p in report.problems] == [[m["rank_files"][0], "sha256"]]
    m["files"][m["rank_files"][0]].pop("sha256")
    with open(path, "w") as f:
        json.dump(m, f)
    assert "has no checksum" in verify(out).problems[0]


def test_verify_reports_missing_files_and_uncommitted_folders(trainer_ckpt, tmp_path):
    out = str(tmp_path / "d")
    reshard(trainer_ckpt, out, to="dcp:2")
    assert verify(out).ok and verify(out).files == len(json.load(open(os.path.join(out, "manifest.json")))["files"])
    os.remove(os.path.join(out, "dcp", "__1_0.distcp"))
    assert verify(out).problems == ["dcp/__1_0.distcp is missing"]
    assert not verify(str(tmp_path / "nothing")).ok


def test_outputs_on_an_fsspec_url_round_trip(tiny, trainer_ckpt, tmp_path):
    model, _, _ = tiny
    reshard(trainer_ckpt, "memory://reshard-test/tp2", to="tp:2")
    reshard("memory://reshard-test/tp2", "memory://reshard-test/hf", to="hf")
    assert verify("memory://reshard-test/hf").ok
    reshard("memory://reshard-test/hf", str(tmp_path / "hf"), to="hf")
    state = load_state_dict(str(tmp_path / "hf"))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_policy_store_publishes_through_reshard_with_its_manifest_keys(tiny, trainer_ckpt, tmp_path):
    from pipeline.policy import PolicyStore
    from pipeline.rundir import RunDir

    model, _, full = tiny
    run = RunDir(str(tmp_path / "run-1"))
    store = PolicyStore(run)
    assert store.publish_folder(0, full, {"step": 0, "source": "builtin"})
    assert not store.publish_folder(0, full)  # a retried task
    m = store.manifest(0)
    assert (m["version"], m["format"], m["source"]) == (0, "hf", "builtin")
    assert set(m["files"]["model.safetensors"]) == {"bytes", "xxh3_128"} and m["manifest_version"] == 2

    from pipeline.models import load_tokenizer

    assert store.publish_model(1, model, load_tokenizer(full), {"step": 1})
    assert store.publish_checkpoint(4, trainer_ckpt).published_now
    assert not store.publish_checkpoint(4, trainer_ckpt).published_now
    assert store.versions() == [0, 1, 4] and store.latest() == 4
    assert store.manifest(4)["step"] == 4 and store.verify(4).ok
    state = load_state_dict(store.local_dir(1))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_cli_converts_and_verifies(trainer_ckpt, tmp_path, capsys):
    from pipeline.cli import main

    out = str(tmp_path / "tp2")
    assert main(["reshard", trainer_ckpt, out, "--to", "tp:2", "--policy-version", "6"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert (line["format"], line["version"], line["committed_now"]) == ("tp:2", 6, True)
    assert main(["reshard", "--verify", out]) == 0
    os.remove(os.path.join(out, "config.json"))
    assert main(["reshard", "--verify", out]) == 1
    assert "config.json is missing" in capsys.readouterr().out
    assert main(["reshard", trainer_ckpt, str(tmp_path / "x"), "--to", "tp:3"]) == 2
    assert "does not divide" in capsys.readouterr().err
    # bad input is one line, not a traceback
    for bad in ("nan", "inf", "0"):
        assert main(["reshard", trainer_ckpt, str(tmp_path / "y"), "--to", "hf", "--max-shard-gb", bad]) == 2
        assert "--max-shard-gb" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert main(["reshard", trainer_ckpt, str(tmp_path / "a-file"), "--to", "hf"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["files"]["config.json"] = "not an entry"
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    assert main(["reshard", "--verify", out]) == 1
    assert "config.json: its manifest entry is not an object" in capsys.readouterr().out


@pytest.mark.parametrize("choices", [(10, 300, 1000, 16), (16, 160, 320, 1000)])  # the second: exact fits
def test_tensors_in_flight_stay_within_the_ring_and_are_never_overwritten_while_held(choices):
    import random
    import time

    from pipeline.reshard.engine import _stream
    from pipeline.reshard.layout import TensorSpec

    rng = random.Random(0)
    sizes = [rng.choice(choices) for _ in range(300)]
    specs = [TensorSpec(f"t{i}", (n,), torch.float32) for i, n in enumerate(sizes)]
    held = {"now": 0, "max": 0, "checked": 0}

    class Source:
        copyable = False

        def read(self, name, out):
            i = int(name[1:])
            held["now"] += specs[i].nbytes
            held["max"] = max(held["max"], held["now"])
            out.fill_(float(i))
            return out

    class Sink:
        def wants_bytes(self, spec):
            return True

        def write(self, spec, t, segments):
            time.sleep(0.0002 * (int(spec.name[1:]) % 3))  # let the reader run ahead and wrap around
            assert bool((t == float(spec.name[1:])).all()), spec.name  # not overwritten by a later read
            held["now"] -= spec.nbytes
            held["checked"] += 1

    _stream(Source(), Sink(), specs, capacity=5120)
    assert held["checked"] == len(specs) and held["now"] == 0
    assert 4000 <= held["max"] <= 5120


def test_local_bytes_pass_through_the_kernel_copy_and_still_match_their_checksums(tiny, trainer_ckpt, tmp_path,
                                                                                  monkeypatch):
    from pipeline.reshard import files

    calls = {"n": 0}
    real = files.os.copy_file_range

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(files.os, "copy_file_range", counting)
    from pipeline.reshard import sources

    reads = []
    for cls in (sources.HFSource, sources.DCPSource):
        real_read = cls.read
        monkeypatch.setattr(cls, "read", lambda self, name, out=None, _r=real_read: reads.append(name) or _r(self, name, out))
    reshard(trainer_ckpt, str(tmp_path / "hf"), to="hf")
    from_dcp = calls["n"]
    assert reads == []  # every tensor went file to file
    reshard(str(tmp_path / "hf"), str(tmp_path / "tp2"), to="tp:2")
    assert from_dcp > 0 and calls["n"] > from_dcp
    assert sorted(reads) == sorted(f"model.layers.{i}.{m}.weight" for i in range(2)
                                   for m in ("self_attn.o_proj", "mlp.down_proj"))  # only row-parallel ones
    assert verify(str(tmp_path / "hf")).ok and verify(str(tmp_path / "tp2")).ok
    state = load_state_dict(str(tmp_path / "hf"))
    assert all(torch.equal(v, state[k]) for k, v in tiny[0].state_dict().items())


def test_tensors_a_local_source_cannot_locate_are_read_whole_and_give_the_same_bytes(trainer_ckpt, tmp_path,
                                                                                   monkeypatch):
    """The ring is sized only for the tensors the sink must see in memory; a tensor the source
    unexpectedly cannot locate on disk (e.g. a chunk saved as a view) is read into memory of its own."""
    from pipeline.reshard import sources

    copied = str(tmp_path / "copied")
    reshard(trainer_ckpt, copied, to="hf")
    monkeypatch.setattr(sources.DCPSource, "locate", lambda self, name: None)
    read = str(tmp_path / "read")
    reshard(trainer_ckpt, read, to="hf")
    with open(os.path.join(copied, "manifest.json")) as a, open(os.path.join(read, "manifest.json")) as b:
        assert json.load(a)["files"] == json.load(b)["files"]
    assert verify(read).ok


def test_early_writeback_while_writing_changes_no_byte(trainer_ckpt, tmp_path, monkeypatch):
    from pipeline.reshard import files

    plain = {to: str(tmp_path / f"plain-{to}") for to in ("hf", "tp:2")}
    for to, out in plain.items():
        reshard(trainer_ckpt, out, to=to)
    calls = []
    real = files._start_writeback
    assert real is not None, "sync_file_range should be available on Linux"

    def spy(fd, offset, length, flags):
        calls.append((offset, length))
        return real(fd, offset, length, flags)

    monkeypatch.setattr(files, "_start_writeback", spy)
    monkeypatch.setattr(files, "WRITEBACK", 4096)
    for to, out in plain.items():
        early = str(tmp_path / f"early-{to}")
        reshard(trainer_ckpt, early, to=to)
        assert verify(early).ok
        assert {k: v[0] for k, v in _snapshot(early).items()} == {k: v[0] for k, v in _snapshot(out).items()}
    assert len(calls) > 10 and all(length >= 4096 for _, length in calls)
