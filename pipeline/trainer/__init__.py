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
    checkpoint   DCP checkpoints (checkpoints/step_<N>/{dcp,hf,meta.json}), resume, retention
    publish      policy versions: in-phase publication, phase-boundary reshard
    phases       phase markers, replay gates, `advance` (what an orchestrator does)
    loop         the persistent loop (`run_trainer`)
"""
