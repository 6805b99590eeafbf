"""Resharding to and from a real S3 endpoint (moto's server): any fsspec URL on either side."""

import sys
from pathlib import Path

import pytest
import torch

from pipeline.reshard import publish, reshard, verify
from pipeline.storage import url_to_fs
from pipeline.weights import load_state_dict

sys.path.insert(0, str(Path(__file__).parent.parent / "buffer"))
from s3_endpoint import moto_s3, new_prefix  # noqa: E402


@pytest.mark.integration
def test_checkpoint_on_s3_reshards_to_s3_and_back_bit_exactly(tiny, trainer_ckpt, tmp_path):
    model, _, _ = tiny
    with moto_s3("reshard-test") as bucket:
        base = new_prefix(bucket)
        fs, root = url_to_fs(base)
        fs.put(trainer_ckpt.rstrip("/") + "/", f"{root}/step_4/", recursive=True)

        m = reshard(f"{base}/step_4", f"{base}/tp2", to="tp:2")
        assert (m["source_format"], m["step"]) == ("dcp:1", 4)
        reshard(f"{base}/tp2", f"{base}/hf", to="hf")
        assert verify(f"{base}/hf").ok
        _, created = publish(f"{base}/tp2", f"{base}/hf", "hf")
        assert not created  # the committed output verifies: nothing is rewritten

        reshard(f"{base}/hf", str(tmp_path / "hf"), to="hf")
        state = load_state_dict(str(tmp_path / "hf"))
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
