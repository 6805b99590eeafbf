"""Policy versions from the trainer: in-phase publication and the phase-boundary reshard.

In-phase (`publish_policy`, every `trainer.sync_every` steps): the sharded weights are gathered to
rank 0 and committed as `policy/v<step>/` through `PolicyStore` (safetensors + config +
tokenizer, manifest last).

Phase boundary (`publish_phase_checkpoint`): the checkpoint closing a phase becomes `policy/v<step>`
through `pipeline.reshard.publish_checkpoint` (the DAG's reshard task calls the same function).

Retention (`prune_policies`, rank 0 after each in-phase publication; the trainer is the one deleter):
the newest `trainer.keep_policy_versions` versions stay, and so do v0 (the reference policy and
every trainer's starting weights), each phase-end version (the last one is the final policy that
finalize exports) and any version a sampler is loading (its lease, see `PolicyStore.retain`).
"""

from __future__ import annotations

import os
import tempfile

import torch

from ..policy import PolicyStore
from ..config import TrainerConfig
from ..runs import RunDir
from .distributed import World
from .phases import phase_end_steps


def _save_folder(folder: str, weights: dict[str, torch.Tensor], config, generation_config, tokenizer) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def publish_policy(run: RunDir, version: int, actor, tokenizer, world: World, meta: dict | None = None) -> bool:
    """Gather the policy's full weights to rank 0 and publish them (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    store = PolicyStore(run)
    if store.exists(version):  # e.g. a resumed trainer redoing a step: same data, same weights
        world.barrier()
        return False
    sd = get_model_state_dict(actor.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    published = False
    if world.is_main:
        with tempfile.TemporaryDirectory(prefix="policy-") as tmp:
            _save_folder(tmp, sd, actor.policy.config, getattr(actor.policy, "generation_config", None), tokenizer)
            published = store.publish_folder(version, tmp, {"step": version, "source": "trainer", **(meta or {})})
    world.barrier()
    return published


def publish_phase_checkpoint(run_url: str, checkpoint_url: str, version: int) -> bool:
    """Reshard a trainer checkpoint into `policy/v<version>/` (idempotent)."""
    from ..reshard import publish_checkpoint

    return bool(publish_checkpoint(run_url, checkpoint_url, version))


def prune_policies(store: PolicyStore, tc: TrainerConfig) -> list[int]:
    """Delete the in-phase versions beyond the newest `tc.keep_policy_versions`. Returns those deleted."""
    return store.retain(tc.keep_policy_versions, protected={0, *phase_end_steps(tc)})
