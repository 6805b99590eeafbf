"""Run under `python -m torch.distributed.run --standalone --nproc-per-node 2`: an FSDP2 trainer's
side of the checkpoint contract.

    save HF_FULL HF_META DST          shard the model with FSDP2 and write a checkpoint with save_dcp
    load HF_META OUT CKPT [CKPT...]   load each checkpoint into an FSDP2 model, write its logits to OUT
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def sharded(model):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def logits(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    with torch.no_grad():
        return model(input_ids=ids).logits


def main(argv):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.reshard import save_dcp

    if argv[0] == "save":
        full, meta, dst = argv[1:]
        model = sharded(AutoModelForCausalLM.from_pretrained(full, local_files_only=True, dtype=torch.float32))
        state = {"model": model.state_dict(), "extra": {"cursor": torch.tensor([3])}}
        save_dcp(state, dst, meta, step=7, world_size=dist.get_world_size(), policy_version=7)
    else:
        meta, out, *ckpts = argv[1:]
        results = {}
        for i, ckpt in enumerate(ckpts):
            torch.manual_seed(100 + i)  # different random init: the load must overwrite every weight
            model = sharded(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(meta), dtype=torch.float32))
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=f"{ckpt}/dcp")
            model.load_state_dict(state["model"])
            results[f"logits_{i}"] = logits(model.eval()).contiguous()
        if dist.get_rank() == 0:
            save_file(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
