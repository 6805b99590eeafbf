"""Which accelerators each device-heavy process of a run gets, and how many CPU threads it uses.

A machine's accelerators (those its processes see: `CUDA_VISIBLE_DEVICES`, else the CUDA device
count; `devices.count` overrides) are split between sampling and training by
`devices.sampler_share` (0.3 by default): the sampler takes the first ceil-rounded share, at least
one, and the trainer the rest, at least one. Whoever starts a process (the local runner, the
Airflow operator) sets its `CUDA_VISIBLE_DEVICES` from this split, so the sampler and the trainer
never both take `cuda:0`. Evaluation and finalize run after the trainer, on its accelerators.

With a single accelerator both must share it: the sampler is then told the share of its memory
it may take (`RLHF_GPU_MEMORY_FRACTION`, which the vLLM backend passes as
`gpu_memory_utilization` unless the config sets that itself). Sampler replicas that take the
sampling accelerators in turn (more replicas than accelerators) are told theirs likewise: vLLM's
default share split between the replicas on one accelerator. On a CPU-only machine nothing is set.

Where each task gets accelerators of its own (a Celery worker per GPU, a Kubernetes pod with its
own `nvidia.com/gpu` limit), the deployment sets `RLHF_DEDICATED_DEVICES=1`: a process then takes
every accelerator it sees, whatever its role, and the sampler is not told to share its memory.
"""

from __future__ import annotations

import math
import os
from typing import Mapping

# The Airflow pool of accelerator slots that device-heavy tasks take (plugins/taskgroups.py) and that
# a deployment creates with slots = devices (`rlhf airflow up` does for the local one).
DEVICE_POOL = "rlhf_devices"
ROLE_DEVICES = {"sampler": "sampler", "trainer": "trainer", "finalize": "trainer", "eval": "trainer"}
MEMORY_FRACTION_ENV = "RLHF_GPU_MEMORY_FRACTION"
SAMPLING_MEMORY_SHARE = 0.9  # vLLM's default gpu_memory_utilization: what replicas on one sampling GPU split
DEDICATED_ENV = "RLHF_DEDICATED_DEVICES"
_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, AMD's (ROCm)


def dedicated(env: Mapping[str, str] | None = None) -> bool:
    """Whether the accelerators this process sees belong to its task alone (see the module doc)."""
    return (os.environ if env is None else env).get(DEDICATED_ENV, "").strip().lower() in ("1", "true", "yes")


def visible_devices(env: Mapping[str, str] | None = None, count: int | None = None) -> list[str]:
    """Ids of the accelerators a process started with `env` would see (at most `count`)."""
    env = os.environ if env is None else env
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [x.strip() for x in listed.split(",") if x.strip() and x.strip() != "-1"]
    elif count is not None:
        ids = [str(i) for i in range(count)]
    elif not _gpu_driver():
        ids = []  # no GPU driver on this machine: nothing to count, and no torch import to count it
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    return ids if count is None else ids[:count]


def _gpu_driver() -> bool:
    """Whether this machine has a GPU driver (no torch import to ask it)."""
    return any(os.path.exists(p) for p in _DRIVER_PATHS)


def split_devices(ids: list[str], sampler_share: float) -> dict[str, list[str]]:
    """{"sampler": [...], "trainer": [...]}: disjoint when there are two or more accelerators."""
    if len(ids) <= 1:
        return {"sampler": list(ids), "trainer": list(ids)}
    n = min(max(1, math.ceil(len(ids) * sampler_share - 1e-9)), len(ids) - 1)
    return {"sampler": ids[:n], "trainer": ids[n:]}


def role_environment(role: str, devices_cfg, env: Mapping[str, str] | None = None, *, replica: int = 0,
                     replicas: int = 1) -> dict[str, str]:
    """Variables to set for the process of `role` (sampler, trainer, finalize, eval). Sampler
    replica `replica` of the `replicas` on this machine gets its own slice of the sampling
    accelerators (with fewer accelerators than replicas, one of them in turn)."""
    if role not in ROLE_DEVICES:
        raise ValueError(f"role {role!r}: choose one of {', '.join(ROLE_DEVICES)}")
    ids = visible_devices(env, devices_cfg.count)
    if not ids:
        return {}
    if dedicated(env):
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}
    split = split_devices(ids, devices_cfg.sampler_share)
    mine = split[ROLE_DEVICES[role]]
    if ROLE_DEVICES[role] == "sampler" and replicas > 1:
        mine = replica_slice(mine, replica, replicas)
    out = {"CUDA_VISIBLE_DEVICES": ",".join(mine)}
    sampling = split["sampler"]
    if ROLE_DEVICES[role] == "sampler" and len(ids) == 1:
        out[MEMORY_FRACTION_ENV] = f"{devices_cfg.sampler_share / replicas:.3f}"
    elif ROLE_DEVICES[role] == "sampler" and replicas > len(sampling):  # replica_slice: one in turn
        sharing = sum(replica_slice(sampling, r, replicas) == mine for r in range(replicas))  # on this one
        out[MEMORY_FRACTION_ENV] = f"{SAMPLING_MEMORY_SHARE / sharing:.3f}"
    return out


def replica_slice(ids: list[str], replica: int, replicas: int) -> list[str]:
    """Replica `replica`'s share of `ids`: contiguous equal slices, or one id in turn when short."""
    if len(ids) < replicas:
        return [ids[replica % len(ids)]]
    per = len(ids) // replicas
    return ids[replica * per:(replica + 1) * per]


def trainer_ranks(devices_cfg, nproc_per_node: int, env: Mapping[str, str] | None = None) -> int:
    """Trainer processes on this machine: one per trainer accelerator when there are any and
    the config leaves `trainer.nproc_per_node` at 1; otherwise the config's count, which must not
    exceed the trainer's accelerators (a rank takes one of its own: `cuda:LOCAL_RANK`)."""
    ids = visible_devices(env, devices_cfg.count)
    if not ids:
        return nproc_per_node
    mine = ids if dedicated(env) else split_devices(ids, devices_cfg.sampler_share)["trainer"]
    if nproc_per_node == 1:
        return len(mine)
    # CUDA_VISIBLE_DEVICES set on a machine without a GPU driver (a CPU job of a cluster
    # scheduler): the ranks run on CPU, as many as asked
    if nproc_per_node > len(mine) and _gpu_driver():
        from .config_yaml import ConfigError

        raise ConfigError(f"trainer.nproc_per_node={nproc_per_node}: the trainer has {len(mine)} accelerator(s) on "
                          f"this machine (ids {','.join(mine)}: devices.sampler_share {devices_cfg.sampler_share} "
                          f"of {len(ids)} visible), and each rank takes one of its own: set it to at most "
                          f"{len(mine)} (1: one rank per accelerator)")
    return nproc_per_node


def engine_loaded() -> None:
    """The end of an engine's start-up (`rlhf sampler`, `rlhf trainer`), which runs with the cyclic
    garbage collector off (`pipeline.cli`): what is alive now (libraries, model, tokenizer) moves to
    the permanent generation (`gc.freeze`), and collection resumes for what the loop allocates.

    Importing torch and transformers and loading a model allocate ~10^6 objects that live as long
    as the process. With the collector on, the growing heap set off 5-7 full collections during
    start-up (0.3 s on the demo's sampler) and every full collection of the loop scanned it again
    (0.1-0.15 s each). Constructing the demo's sampler took 2.60-2.63 s this way against 3.01-3.09 s,
    alternating in fresh processes. What became cyclic garbage during start-up is frozen with the
    rest and never freed: 11k objects, 7 MB, on that sampler (435 MB resident); a collection to
    free it would cost 0.26 s. Called where the collector is on (an engine run in-process), it does
    nothing."""
    import gc

    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def set_threads(n: int) -> None:
    """Explicit thread counts: two busy processes on two cores slow each other badly otherwise."""
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set in this process
