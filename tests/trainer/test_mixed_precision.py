"""Mixed precision: float32 master weights and optimizer state, compute in bfloat16."""

import torch
from trainer_rollouts import rollout_table

from pipeline.config import parse_config
from pipeline.models import load_model, load_tokenizer
from pipeline.trainer.batch import collate
from pipeline.trainer.critic import ActorCritic
from pipeline.trainer.distributed import World
from pipeline.trainer.loop import build_models
from pipeline.trainer.precision import Precision, compute_module
from pipeline.trainer.step import train_step

REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2]


def _setup(example, dtype: str, lr: float, serve: str | None = None):
    """`dtype`: the trainer's compute dtype; `serve`: model.dtype when it differs (trainer.dtype)."""
    torch.manual_seed(0)
    model = {"dtype": serve or dtype}
    cfg = parse_config({"model": model, "trainer": {"lr": lr, "kl_coef": 0.0, "dtype": dtype if serve else None}})
    world = World()
    precision = Precision.of(dtype, world.device, sharded=False)
    actor, _ = build_models(f"{example}/model", cfg, world, precision)
    opt = torch.optim.AdamW(actor.policy.parameters(), lr=lr)
    tok = load_tokenizer(f"{example}/model")
    return cfg, actor, opt, precision, tok


def test_bf16_run_keeps_fp32_master_weights_that_move_at_lr_1e6(digit_example):
    cfg, actor, opt, precision, tok = _setup(digit_example, "bfloat16", 1e-6)
    assert {p.dtype for p in actor.policy.parameters()} == {torch.float32}
    batch = collate(rollout_table(tok, REWARDS), tok.pad_token_id)
    seen = {}
    hook = compute_module(actor.policy).model.layers[0].mlp.register_forward_hook(
        lambda m, i, o: seen.update(mlp=o.dtype))
    with torch.no_grad():
        logits = actor.policy(input_ids=batch.input_ids[:1]).logits
    hook.remove()
    assert seen["mlp"] == torch.bfloat16  # computes in bf16 ...
    assert logits.dtype == torch.float32  # ... but for the LM head (the log-probs), on CPU
    assert actor.policy.config._attn_implementation == "eager"  # the CPU flash kernel's bf16 backward is slow
    before = {k: v.clone() for k, v in actor.policy.named_parameters()}
    train_step(actor, None, opt, batch, cfg.trainer, 1.0, precision=precision)
    moved = [k for k, v in actor.policy.named_parameters() if not torch.equal(v, before[k])]
    assert set(moved) == set(before)
    assert {s["exp_avg"].dtype for s in opt.state.values()} == {torch.float32}
    assert set(actor.policy.state_dict()) == set(load_model(f"{digit_example}/model", "float32").state_dict())


def test_on_cpu_the_bf16_copy_follows_its_master_and_accumulates_gradients_in_fp32(digit_example):
    """The compute copy (pipeline.trainer.precision): a change of the float32 weights (an optimizer
    step, a checkpoint loaded) reaches the next forward pass, and two micro-batches' gradients add
    up in float32 on the master, as one pass over both would give them."""
    cfg, actor, opt, precision, tok = _setup(digit_example, "bfloat16", 1e-3)
    policy, twin = actor.policy, compute_module(actor.policy)
    assert twin is not policy and {p.dtype for p in twin.model.parameters()} == {torch.bfloat16}
    ids = collate(rollout_table(tok, REWARDS), tok.pad_token_id).input_ids
    with torch.no_grad():
        before = policy(input_ids=ids).logits
        policy.model.norm.weight.mul_(0.5)  # a copied weight, changed in place
        halved = policy(input_ids=ids).logits
        policy.lm_head.weight.mul_(2.0)  # the head computes on the master's own weights
        doubled = policy(input_ids=ids).logits
    assert torch.equal(twin.model.norm.weight, policy.model.norm.weight.to(torch.bfloat16))
    assert torch.allclose(halved, before * 0.5, atol=1e-5) and torch.allclose(doubled, before, atol=1e-5)
    policy.load_state_dict(load_model(f"{digit_example}/model", "float32").state_dict())
    with torch.no_grad():
        assert torch.allclose(policy(input_ids=ids).logits, before)

    def grads(*parts):
        policy.zero_grad(set_to_none=True)
        for rows in parts:
            policy(input_ids=ids[rows]).logits.float().logsumexp(-1).sum().backward()
        assert all(p.grad is None for p in twin.model.parameters())  # moved to the master as they came
        return {k: p.grad.clone() for k, p in policy.named_parameters()}

    split, whole = grads(slice(0, 4), slice(4, None)), grads(slice(None))
    assert {g.dtype for g in split.values()} == {torch.float32} and set(split) == set(whole)
    for k in whole:
        assert torch.allclose(split[k], whole[k], rtol=0.05, atol=1e-2 * whole[k].abs().max().item()), k


def test_the_same_update_on_bf16_parameters_rounds_away(digit_example):
    """Why master weights: AdamW on bfloat16 parameters at lr 1e-6 leaves most of them unchanged."""
    torch.manual_seed(0)
    model = load_model(f"{digit_example}/model", "bfloat16").train()
    tok = load_tokenizer(f"{digit_example}/model")
    cfg = parse_config({"trainer": {"lr": 1e-6}})
    before = {k: v.clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    train_step(ActorCritic(model), None, opt, collate(rollout_table(tok, REWARDS), tok.pad_token_id), cfg.trainer, 1.0)
    changed = sum(int((v != before[k]).sum()) for k, v in model.named_parameters())
    total = sum(v.numel() for v in before.values())
    assert changed / total < 0.05


def test_bf16_loss_curve_tracks_the_fp32_run(digit_example):
    curves = {}
    for dtype in ("float32", "bfloat16"):
        cfg, actor, opt, precision, tok = _setup(digit_example, dtype, 2e-3)
        losses = []
        for step in range(8):
            rewards = REWARDS[step % 4:] + REWARDS[:step % 4]
            batch = collate(rollout_table(tok, rewards), tok.pad_token_id)
            res = train_step(actor, None, opt, batch, cfg.trainer, 1.0, precision=precision)
            losses.append((res.loss, res.stats["actor/entropy"]))
        curves[dtype] = losses
    for (loss32, ent32), (loss16, ent16) in zip(curves["float32"], curves["bfloat16"]):
        assert abs(loss32 - loss16) < 0.01 and abs(ent32 - ent16) < 0.05, curves
    assert curves["float32"][-1][1] < curves["float32"][0][1] - 0.5  # it learns: tracking it says something


def test_trainer_dtype_computes_in_bf16_and_publishes_in_the_serving_dtype(tmp_path):
    """trainer.dtype=bfloat16 with model.dtype=float32 (a CPU with bf16 matrix units): the trainer
    computes in bf16 and the versions it publishes stay float32, the dtype the sampler loads."""
    from pipeline.orchestration import prepare
    from pipeline.policy import PolicyStore
    from safetensors.torch import load_file

    from pipeline.trainer.loop import Trainer

    cfg = parse_config({"model": {"path": "builtin:digit"}, "data": {"train": "builtin:digit", "eval": "builtin:digit",
                        "eval_size": 8}, "reward": {"fn": "digit"}, "trainer": {"dtype": "bfloat16"}})
    run = prepare(cfg, run_url=str(tmp_path / "run"))
    t = Trainer(run, World())
    assert t.precision.dtype == torch.bfloat16 and t.actor.policy.config._attn_implementation == "eager"
    t.state.step = 1
    t._publish(None)
    weights = load_file(f"{PolicyStore(run).local_dir(1)}/model.safetensors")
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float32}
