"""Policy versions from the trainer: in-phase publication and retention.

In-phase (`publish_policy`, every `trainer.sync_every` steps): the sharded weights are gathered to
rank 0 and committed as `policy/v<step>/` through `PolicyStore.publish_model` (safetensors +
config + tokenizer, manifest last). The checkpoint closing a phase becomes `policy/v<step>` through
`PolicyStore.publish_checkpoint`, which the orchestrator calls (the DAG's reshard task, the local
runner's `advance`), not the trainer.

Retention (`prune_policies`, rank 0 after each in-phase publication; the trainer is the one deleter):
the newest `trainer.keep_policy_versions` versions stay, and so do v0 (the reference policy and
every trainer's starting weights), each phase-end version (the last one is the final policy that
finalize exports) and any version a sampler is loading (its lease, see `PolicyStore.retain`).
"""

from __future__ import annotations

from ..config import TrainerConfig
from ..policy import PolicyStore
from ..rundir import RunDir
from .distributed import World
from .phases import phase_end_steps


def publish_policy(run: RunDir, version: int, actor, tokenizer, world: World, meta: dict | None = None,
                   dtype=None) -> bool:
    """Gather the policy's full weights to rank 0 and publish them (collective), cast to `dtype`
    (the serving dtype; the trainer's float32 master weights otherwise)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    store = PolicyStore(run)
    if store.exists(version):  # e.g. a resumed trainer redoing a step: same data, same weights
        world.barrier()
        return False
    weights = get_model_state_dict(actor.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dtype is not None:
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    published = False
    if world.is_main:
        published = store.publish_model(version, actor.policy, tokenizer,
                                        {"step": version, "source": "trainer", **(meta or {})}, weights=weights)
    world.barrier()
    return published


def prune_policies(store: PolicyStore, tc: TrainerConfig) -> list[int]:
    """Delete the in-phase versions beyond the newest `tc.keep_policy_versions`. Returns those deleted."""
    return store.retain(tc.keep_policy_versions, protected={0, *phase_end_steps(tc)})
