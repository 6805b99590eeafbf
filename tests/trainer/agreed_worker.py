"""One rank of tests/trainer/test_feed.py's agreement test: rank 0 meets `OUTCOME`, rank 1 gets its data."""

import json
import sys

import torch.distributed as dist

from pipeline.trainer.distributed import World
from pipeline.trainer.feed import TrainerStopped, agreed


def main(rank: int, store: str, outcome: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    world = World(rank=rank, size=2)

    def wait():
        if rank == 0 and outcome == "stop":
            raise TrainerStopped()
        if rank == 0 and outcome == "timeout":
            raise TimeoutError("no fresh groups")
        if rank == 0 and outcome == "error":
            raise OSError("storage unreachable")
        return "groups"

    try:
        result = agreed(world, wait)
    except Exception as e:  # noqa: BLE001
        result = type(e).__name__
    world.barrier()  # every rank is still in step with the others: nothing went on alone
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), *sys.argv[2:])
