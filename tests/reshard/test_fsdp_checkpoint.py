"""A real FSDP2 trainer (two gloo ranks) writes the checkpoint; reshard reads it, and the trainer
loads reshard's dcp outputs at another world size."""

import os
import sys

import pytest
import torch
from reshard_loaders import load_hf, logits
from safetensors.torch import load_file
from spawner import Spawner
from torch.distributed.checkpoint.metadata import MetadataIndex

from pipeline.reshard import reshard
from pipeline.reshard.dcp_io import read_metadata
from pipeline.storage import url_to_fs
from pipeline.weights import load_state_dict

WORKER = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")


def _torchrun(*args, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER, *args]
    done = Spawner().run(cmd, env=env, capture_output=True, text=True, timeout=timeout)  # workers killed if it fails
    assert done.returncode == 0, done.stderr[-3000:]


def _chunks_by_file(folder):
    md = read_metadata(*url_to_fs(f"{folder}/dcp/.metadata"))
    out = {}
    for key, item in md.state_dict_metadata.items():
        if key.startswith("model."):
            for c in item.chunks:
                info = md.storage_data[MetadataIndex(key, c.offsets)]
                out[(key, tuple(c.offsets))] = (tuple(c.sizes), info.relative_path)
    return out


@pytest.mark.integration
def test_fsdp2_checkpoint_reshards_bit_exactly_and_reloads_at_other_world_sizes(tiny, tmp_path):
    model, meta, full = tiny
    want = logits(model)
    ckpt = str(tmp_path / "checkpoints" / "step_7")
    _torchrun("save", full, meta, ckpt)
    assert sorted(os.listdir(ckpt)) == ["dcp", "hf", "meta.json"]

    hf = str(tmp_path / "hf")
    m = reshard(ckpt, hf, to="hf")
    assert (m["source_format"], m["step"], m["version"]) == ("dcp:2", 7, 7)
    state = load_state_dict(hf)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    torch.testing.assert_close(logits(load_hf(hf)), want, rtol=0, atol=1e-6)

    ours = str(tmp_path / "dcp2")
    reshard(hf, ours, to="dcp:2")
    assert _chunks_by_file(ours) == _chunks_by_file(ckpt)  # the chunk layout FSDP2 itself writes

    reshard(hf, str(tmp_path / "dcp1"), to="dcp:1")
    reshard(hf, str(tmp_path / "dcp3"), to="dcp:3")
    out = str(tmp_path / "logits.safetensors")
    _torchrun("load", meta, out, str(tmp_path / "dcp1"), str(tmp_path / "dcp3"), ours)
    for name, got in load_file(out).items():
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
