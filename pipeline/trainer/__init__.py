"""The trainer: RL updates on fresh and replayed rollouts, one process or FSDP2 under torchrun.

    rlhf trainer --run-dir URL                                      # one process
    torchrun --nproc-per-node 2 -m pipeline trainer --run-dir URL   # FSDP2 (gloo on CPU, NCCL on GPU)

Modules, one concept each:

    algorithms   registry: grpo, dr_grpo, rloo, reinforce_pp, ppo (critic)
    advantages   sequence-level estimators; token-level GAE and V-trace
    losses       decoupled PPO objective with truncated IS, KL (k1/k3), value loss, aggregation
    batch        rollout rows -> tensors, token-budget micro-batches, groups dealt to ranks
    critic       the value head of PPO
    step         one optimizer step: advantages, micro-batches, accumulation, statistics
    distributed  process group, FSDP2 sharding, collectives
    checkpoint   what a checkpoint holds, resume, retention (layout: pipeline.reshard.checkpoint)
    publish      policy versions: in-phase publication, retention of old versions
    phases       when phases end and replay epochs fall due
    loop         the persistent loop (`run_trainer`)
"""
