"""One or several trainer processes: process group, device, FSDP2 sharding, small collectives.

Under `torchrun --nproc-per-node N` (env RANK / WORLD_SIZE set) the trainer joins a process group
(NCCL on GPUs, gloo on CPU) and shards the policy with FSDP2 `fully_shard`: each decoder layer,
then the whole model. Without torchrun it is one process and no collective is ever called.

Data split: every rank reads the same groups from the buffer (reads are side-effect free and
deterministic by cursor) and trains on its share of them (`batch.shard_groups`); rank 0 alone
writes what must happen once (buffer commits, metrics, markers, checkpoint meta, policies).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (a no-op in one process)."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def max_int(self, n: int) -> int:
        return int(self.max_(torch.tensor([n], dtype=torch.long, device=self.comm_device))[0])

    @property
    def comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def init_world() -> World:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda and local >= torch.cuda.device_count():
        raise RuntimeError(f"trainer rank {rank}: LOCAL_RANK {local}, but this process sees {torch.cuda.device_count()} "
                           f"GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at "
                           "most one trainer process per GPU (trainer.nproc_per_node, torchrun --nproc-per-node)")
    if cuda:
        torch.cuda.set_device(device)
    if size <= 1:
        return World(device=device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (size,))
    return World(rank=rank, size=size, local_rank=local, device=device, mesh=mesh)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (the FSDP2 sharding units)."""
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    return list(layers) if layers is not None else []


def shard(module: torch.nn.Module, world: World, policy: bool = True, mp_policy=None) -> torch.nn.Module:
    """FSDP2: shard each decoder layer and then the module itself (a no-op in one process).
    `mp_policy`: a MixedPrecisionPolicy (compute dtype for gathered parameters, fp32 reduction)."""
    if not world.distributed:
        return module
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": world.mesh, **({"mp_policy": mp_policy} if mp_policy is not None else {})}
    if policy:
        for layer in decoder_layers(module):
            fully_shard(layer, **kw)
    fully_shard(module, **kw)
    return module


def full_tensor(t):
    """A DTensor's whole value (a plain tensor is returned as is)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
