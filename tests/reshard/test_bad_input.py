"""Bad checkpoints fail before any output appears, with a message naming what is wrong."""

import json
import os
import pickle
import shutil

import pytest

from pipeline.reshard import ReshardError, reshard, verify


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _no_output(path):
    assert not os.path.exists(path) or not os.listdir(path), os.listdir(path)


def test_missing_dcp_shard_is_named(tiny, trainer_ckpt, tmp_path):
    two = str(tmp_path / "two")
    reshard(trainer_ckpt, two, to="dcp:2")
    os.remove(os.path.join(two, "dcp", "__1_0.distcp"))
    with pytest.raises(ReshardError, match=r"__1_0\.distcp: shard file missing"):
        reshard(two, str(tmp_path / "out"), to="hf")
    _no_output(tmp_path / "out")


def test_overlapping_dcp_chunks_are_refused_not_filled_with_stale_memory(trainer_ckpt, tmp_path):
    """Two chunks at one offset cover the right element count but leave a gap."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    two = str(tmp_path / "two")
    reshard(trainer_ckpt, two, to="dcp:2")
    path = os.path.join(two, "dcp", ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # a file this test wrote
    key = next(k for k, v in md.state_dict_metadata.items()  # two chunks of one size: the count adds up
               if len(getattr(v, "chunks", [])) == 2 and v.chunks[0].sizes == v.chunks[1].sizes)
    c0, c1 = md.state_dict_metadata[key].chunks
    md.state_dict_metadata[key].chunks = [c0, ChunkStorageMetadata(offsets=c0.offsets, sizes=c1.sizes)]
    with open(path, "wb") as f:
        pickle.dump(md, f)
    os.remove(os.path.join(two, "manifest.json"))  # as a trainer's checkpoint, which has none
    with pytest.raises(ReshardError, match=r"chunks \[0(, 0)?\] and \[0(, 0)?\] of .* overlap, so part"):
        reshard(two, str(tmp_path / "out"), to="hf")
    _no_output(tmp_path / "out")


def test_missing_tp_rank_file_is_named(tiny, tmp_path):
    tp = str(tmp_path / "tp")
    reshard(tiny[2], tp, to="tp:2")
    os.remove(os.path.join(tp, "model-tp-rank-00001-of-00002.safetensors"))
    with pytest.raises(ReshardError, match="model-tp-rank-00001-of-00002.safetensors: shard file missing"):
        reshard(tp, str(tmp_path / "out"), to="hf")
    _no_output(tmp_path / "out")


def test_checkpoint_without_meta_json_is_incomplete(trainer_ckpt, tmp_path):
    src = _copy(trainer_ckpt, tmp_path / "step_4")
    os.remove(os.path.join(src, "meta.json"))
    with pytest.raises(ReshardError, match="no meta.json; the checkpoint is incomplete"):
        reshard(src, str(tmp_path / "out"), to="hf")
    _no_output(tmp_path / "out")


def test_shape_that_disagrees_with_config_is_named(tiny, tmp_path):
    src = _copy(tiny[2], tmp_path / "hf")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["intermediate_size"] += 8
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ReshardError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \[128, 384\].*\[128, 392\]"):
        reshard(src, str(tmp_path / "out"), to="tp:2")
    _no_output(tmp_path / "out")


def test_tensor_without_a_tp_rule_is_named_with_the_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ReshardError, match=r"'transformer\.h\.0\.attn\.c_attn\.\w+': no tensor-parallel rule .* of "
                                           r"GPT2LMHeadModel.*'hf' or 'dcp:N'"):
        reshard(str(tmp_path / "gpt2"), str(tmp_path / "out"), to="tp:2")
    _no_output(tmp_path / "out")


def test_truncated_safetensors_file_is_refused(tiny, tmp_path):
    src = _copy(tiny[2], tmp_path / "hf")
    path = os.path.join(src, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(ReshardError, match="past the end of the file; the file is truncated"):
        reshard(src, str(tmp_path / "out"), to="dcp:2")
    _no_output(tmp_path / "out")


def test_dcp_metadata_that_imports_arbitrary_code_is_refused(trainer_ckpt, tmp_path):
    src = _copy(trainer_ckpt, tmp_path / "step_4")

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with open(os.path.join(src, "dcp", ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(ReshardError, match="refusing it"):
        reshard(src, str(tmp_path / "out"), to="hf")
    assert not (tmp_path / "pwned").exists()


def test_destination_inside_the_source_is_refused(tiny, tmp_path):
    src = _copy(tiny[2], tmp_path / "hf")
    with pytest.raises(ReshardError, match="inside it"):
        reshard(src, os.path.join(src, "sub"), to="hf")


def test_destination_holding_another_publication_is_refused(tiny, trainer_ckpt, tmp_path):
    out = str(tmp_path / "out")
    reshard(trainer_ckpt, out, to="hf")
    with pytest.raises(ReshardError, match="already holds hf step 4 version 4 of Qwen2ForCausalLM, not tp:2"):
        reshard(trainer_ckpt, out, to="tp:2")
    assert verify(out).ok


def test_destination_holding_another_models_weights_is_refused_not_kept(tmp_path):
    """hf to hf has no step or version: the architecture and tensors tell two models apart."""
    from pipeline.example import ensure_tiny_arch

    out = str(tmp_path / "out")
    reshard(ensure_tiny_arch("qwen2"), out, to="hf")
    assert reshard(ensure_tiny_arch("qwen2"), out, to="hf")["architecture"] == "Qwen2ForCausalLM"  # a retry
    with pytest.raises(ReshardError, match="of Qwen2ForCausalLM, not hf step None version None of these LlamaForCausalLM"):
        reshard(ensure_tiny_arch("llama3"), out, to="hf")
    other = _copy(ensure_tiny_arch("qwen2"), tmp_path / "another-finetune")  # same base, same shapes
    with pytest.raises(ReshardError, match="already holds"):
        reshard(other, out, to="hf")


@pytest.mark.parametrize("store", ["local", "object"])
def test_a_failure_while_writing_leaves_no_output(tiny, tmp_path, monkeypatch, store):
    """On an object store (memory:// here) closing a file would complete its upload."""
    import fsspec

    from pipeline.reshard import sinks

    calls = {"n": 0}
    real = sinks.SafetensorsWriter.write

    def failing(self, name, t, *rest):
        calls["n"] += 1
        if calls["n"] == 10:
            raise OSError("disk full")
        return real(self, name, t, *rest)

    monkeypatch.setattr(sinks.SafetensorsWriter, "write", failing)
    out = str(tmp_path / "out") if store == "local" else f"memory://{tmp_path.name}/out"
    with pytest.raises(OSError, match="disk full"):
        reshard(tiny[2], out, to="hf", max_shard_bytes=300_000)
    if store == "local":
        _no_output(tmp_path / "out")
    else:
        fs = fsspec.filesystem("memory")
        assert [p for p in fs.find(f"/{tmp_path.name}/out") if p.endswith(".safetensors")] == []
        if fs.exists(f"/{tmp_path.name}"):
            fs.rm(f"/{tmp_path.name}", recursive=True)


def test_tp_manifest_pointing_outside_its_folder_is_refused(tiny, tmp_path):
    tp = str(tmp_path / "tp")
    reshard(tiny[2], tp, to="tp:2")
    path = os.path.join(tp, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["rank_files"][1] = "../hf/model.safetensors"
    os.chmod(path, 0o644)
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ReshardError, match="points outside the folder"):
        reshard(tp, str(tmp_path / "out"), to="hf")


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def test_dcp_metadata_that_imports_arbitrary_code_is_refused_on_resume(trainer_ckpt, tmp_path):
    """The trainer resumes through DCP's loader, whose own reader unpickles `.metadata` as it is."""
    from pipeline.reshard.checkpoint import load_model_weights

    src = _copy(trainer_ckpt, tmp_path / "step_4")
    with open(os.path.join(src, "dcp", ".metadata"), "wb") as f:
        pickle.dump(_Evil(tmp_path / "pwned"), f)
    with pytest.raises(ReshardError, match="refusing it"):
        load_model_weights(src)
    assert not (tmp_path / "pwned").exists()


def test_a_dcp_entry_that_imports_arbitrary_code_is_refused_on_resume(tmp_path):
    """Non-tensor entries (counters, scheduler state) are torch.save bytes, which DCP loads with
    weights_only=False."""
    import torch
    import torch.distributed.checkpoint as dcp

    from pipeline.reshard.checkpoint import dcp_load

    url = str(tmp_path / "dcp")
    dcp.save({"w": torch.zeros(2), "trainer": {"step": 3}}, storage_writer=dcp.FileSystemWriter(url))
    state = {"w": torch.ones(2), "trainer": {"step": 0}}
    dcp_load(state, url)  # plain values load
    assert state["trainer"]["step"] == 3 and torch.equal(state["w"], torch.zeros(2))

    dcp.save({"w": torch.zeros(2), "trainer": {"step": _Evil(tmp_path / "pwned")}},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "evil")))
    with pytest.raises(ReshardError, match="'trainer.step' holds more than plain values"):
        dcp_load({"w": torch.ones(2), "trainer": {"step": 0}}, str(tmp_path / "evil"))
    assert not (tmp_path / "pwned").exists()


def test_weight_files_of_an_uncommitted_write_do_not_outlive_the_committed_output(tiny, tmp_path):
    """A sharded write killed before its commit left an index and shards; the next output is one
    file, and an index beside it would be read in its place."""
    from pipeline.weights import HF_INDEX, load_state_dict

    out = str(tmp_path / "out")
    reshard(tiny[2], out, to="hf", max_shard_bytes=300_000)
    os.remove(os.path.join(out, "manifest.json"))
    assert HF_INDEX in os.listdir(out)
    m = reshard(tiny[2], out, to="hf")
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"] == \
        sorted(f for f in m["files"] if "safetensors" in f)
    assert verify(out).ok and load_state_dict(out).keys() == load_state_dict(tiny[2]).keys()


def test_an_aborted_upload_is_not_completed_when_its_file_object_is_collected():
    """fsspec's own discard() does nothing, and gcsfs's nothing before the first part: a file
    object left open would upload what it holds when it is garbage-collected."""
    import gc

    from fsspec.spec import AbstractBufferedFile

    from pipeline.reshard.files import OutFile

    uploaded = []

    class Upload(AbstractBufferedFile):
        def _initiate_upload(self):
            pass

        def _upload_chunk(self, final=False):
            uploaded.append(self.buffer.tell())
            return True

    class Store:  # a remote store, as OutFile sees one
        protocol = "fake"

        def open(self, path, mode):
            return Upload(self, path, mode=mode, block_size=5 * 2**20)

        def invalidate_cache(self, path=None):
            pass

    out = OutFile(Store(), "bucket/v7/model.safetensors")
    out.write(b"x" * 1000)
    out.abort()
    del out
    gc.collect()
    assert uploaded == []
