import pytest
import torch
from trainer_rollouts import rollout_table

from pipeline.config import TrainerConfig
from pipeline.models import load_model, load_tokenizer
from pipeline.trainer.batch import collate, token_logprobs
from pipeline.trainer.critic import ActorCritic
from pipeline.trainer.step import replay_config, replayable, train_step


def _table(tok, rewards, versions=None):
    return rollout_table(tok, rewards, versions)


def test_parameters_change_after_one_step(digit_example):
    torch.manual_seed(0)
    model = load_model(f"{digit_example}/model").train()
    tok = load_tokenizer(f"{digit_example}/model")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = collate(_table(tok, [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2]), tok.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    res = train_step(ActorCritic(model), None, opt, batch, TrainerConfig(), temperature=1.0)
    loss, stats = torch.tensor(res.loss), res.stats
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    # every trainable matrix moved (rotary buffers are not parameters)
    params = {k for k, _ in model.named_parameters()}
    assert set(changed) >= params, sorted(params - set(changed))[:5]
    assert stats["actor/grad_norm"] > 0 and torch.isfinite(loss)


def test_no_update_when_groups_have_no_reward_variance(digit_example):
    model = load_model(f"{digit_example}/model").train()
    tok = load_tokenizer(f"{digit_example}/model")
    before = {k: v.clone() for k, v in model.named_parameters()}
    batch = collate(_table(tok, [0.5] * 8), tok.pad_token_id)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    res = train_step(ActorCritic(model), None, opt, batch, TrainerConfig(), temperature=1.0)
    loss, stats = torch.tensor(res.loss), res.stats
    assert loss.item() == 0.0 and stats["actor/grad_norm"] == 0.0
    assert all(torch.equal(v, before[k]) for k, v in model.named_parameters())


def test_collate_aligns_behaviour_logprobs_with_response_tokens(digit_example):
    tok = load_tokenizer(f"{digit_example}/model")
    t = _table(tok, [1.0, 0.0, 0.0, 0.0])
    b = collate(t, tok.pad_token_id)
    row = t.to_pylist()[2]
    p, r = len(row["prompt_token_ids"]), len(row["response_token_ids"])
    assert b.mask[2].tolist() == [0.0] * p + [1.0] * r + [0.0] * (b.mask.shape[1] - p - r)
    assert b.input_ids[2, p: p + r].tolist() == row["response_token_ids"]
    assert b.behavior_logprobs[2, p: p + r].tolist() == [-1.0] * r
    model = load_model(f"{digit_example}/model").eval()
    with torch.no_grad():
        lp = token_logprobs(model, b, 1.0)
        logits = model(input_ids=b.input_ids[2:3, : p + r]).logits[0]
    manual = torch.log_softmax(logits[p - 1], -1)[row["response_token_ids"][0]]
    assert torch.allclose(lp[2, p], manual, atol=1e-5)


def test_collate_lays_out_prompt_then_response_per_row_and_checks_the_log_probs():
    import pyarrow as pa
    import pytest

    rows = {"prompt_token_ids": [[9, 9], [1, 2, 3], [4]], "response_token_ids": [[9], [5, 6], [7, 8, 0]],
            "behavior_logprobs": [[-9.0], [-0.5, -0.6], [-0.7, -0.8, -0.1]], "reward": [0.0, 1.0, 0.5],
            "group_id": ["x", "g1", "g2"], "policy_version": [0, 3, 4], "finish_reason": ["stop", "length", "stop"]}
    table = pa.table(rows).slice(1)  # a slice: the list columns start at an offset
    b = collate(table, pad_id=99)
    assert b.input_ids.tolist() == [[1, 2, 3, 5, 6], [4, 7, 8, 0, 99]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert b.mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0]]
    assert torch.allclose(b.behavior_logprobs, torch.tensor([[0, 0, 0, -0.5, -0.6], [0, -0.7, -0.8, -0.1, 0]]))
    assert b.group_ids == ["g1", "g2"] and b.policy_version.tolist() == [3, 4]
    assert b.truncated.tolist() == [True, False]
    rows["behavior_logprobs"][2] = [-0.7]
    with pytest.raises(ValueError, match="row 1: 3 response tokens but 1 behaviour log-probs"):
        collate(pa.table(rows).slice(1), pad_id=99)


def test_lr_scale_shortens_this_step_only(digit_example):
    """A replay update with lr_scale s moves the weights s times as far (plain SGD: the same
    gradient), and the optimizer's learning rate is what it was afterwards."""
    tok = load_tokenizer(f"{digit_example}/model")
    batch = collate(_table(tok, [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2]), tok.pad_token_id)
    moved = {}
    for scale in (1.0, 0.25):
        model = load_model(f"{digit_example}/model").train()
        start = {k: v.clone() for k, v in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step(ActorCritic(model), None, opt, batch, TrainerConfig(), temperature=1.0, lr_scale=scale)
        assert opt.param_groups[0]["lr"] == 0.1
        moved[scale] = torch.cat([(v - start[k]).flatten() for k, v in model.named_parameters()])
    assert moved[1.0].abs().max() > 0
    torch.testing.assert_close(moved[0.25], 0.25 * moved[1.0], rtol=1e-4, atol=1e-7)


def _sgd_update(path, batch, tc, rows="all"):
    """(parameter change of one plain SGD step, the step's result)."""
    model = load_model(path).train()
    start = {k: v.clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = train_step(ActorCritic(model), None, opt, batch, tc, temperature=1.0, rows=rows)
    return torch.cat([(v - start[k]).detach().flatten() for k, v in model.named_parameters()]), res


def test_replay_rows_train_only_the_rows_that_beat_their_group_with_the_whole_groups_advantages(digit_example):
    """rows=positive is the full batch's loss with the other rows weighted 0 (the advantages are
    those of the whole group, not of the rows kept), averaged over the kept rows' tokens: with
    plain SGD, exactly that update scaled by all tokens / kept tokens. rows=best keeps each
    group's highest reward (ties included)."""
    path = f"{digit_example}/model"
    tok = load_tokenizer(path)
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2]  # groups of 4: means 0.375 and 0.55
    table = _table(tok, rewards)
    tc = TrainerConfig(max_grad_norm=1e9)  # no clipping: the update is linear in the loss
    batch = collate(table, tok.pad_token_id)
    kept, res = _sgd_update(path, batch, tc, rows="positive")
    assert res.rows.tolist() == [0, 2, 4, 5]
    weighted, _ = _sgd_update(path, collate(table, tok.pad_token_id, [1, 0, 1, 0, 1, 1, 0, 0]), tc)
    resp = batch.mask.sum(-1)
    scale = float(resp.sum() / resp[res.rows].sum())
    assert kept.abs().max() > 1e-3
    torch.testing.assert_close(kept, weighted * scale, rtol=1e-4, atol=1e-4 * float(kept.abs().max()))
    best, res = _sgd_update(path, batch, tc, rows="best")
    assert res.rows.tolist() == [0, 4, 5]
    assert not torch.allclose(best, kept)


def test_replay_rows_default_to_positive_for_group_algorithms_and_to_all_for_ppo():
    assert TrainerConfig().replay_rows == "positive"
    assert TrainerConfig(algorithm="ppo").replay_rows == "all"  # ppo has token advantages, no groups
    with pytest.raises(ValueError, match="replay_rows=positive picks rows by their group's advantage"):
        TrainerConfig(algorithm="ppo", replay_rows="positive")


def test_rows_with_zero_advantage_skip_forward_and_backward_and_the_update_is_the_same(digit_example, monkeypatch):
    """Groups whose rewards are all equal add nothing to the policy gradient (no KL, no entropy
    bonus): their rows get no forward or backward pass, and the update equals the whole batch's
    (the loss keeps the whole batch's denominator). With an entropy bonus every row trains."""
    import pipeline.trainer.step as step

    path = f"{digit_example}/model"
    tok = load_tokenizer(path)
    batch = collate(_table(tok, [1.0, 0.0, 0.5, 0.0] + [0.7] * 4 + [0.0] * 4 + [0.2, 0.9, 0.9, 0.4]), tok.pad_token_id)
    tc = TrainerConfig(max_grad_norm=1e9)
    rows_seen = []
    real_forward = step.forward
    monkeypatch.setattr(step, "forward", lambda model, mb, *a, **k: rows_seen.append(mb.mask.shape[0]) or
                        real_forward(model, mb, *a, **k))
    skipped, res = _sgd_update(path, batch, tc)
    assert rows_seen == [8] and res.stats["trainer/skipped_rows"] == 8
    with monkeypatch.context() as m:
        m.setattr(step, "_skip_zero_gradient_rows", lambda batch, seq_adv, *a, **k: (batch, seq_adv, 0))
        whole, res_whole = _sgd_update(path, batch, tc)
    assert rows_seen[1:] == [16]
    assert skipped.abs().max() > 1e-4
    torch.testing.assert_close(skipped, whole, rtol=1e-4, atol=1e-5 * float(whole.abs().max()))
    assert res.loss == pytest.approx(res_whole.loss, rel=1e-5)
    assert res.priorities.tolist() == pytest.approx(res_whole.priorities.tolist(), rel=1e-5)
    rows_seen.clear()
    _, res = _sgd_update(path, batch, TrainerConfig(entropy_coef=0.01))
    assert rows_seen == [16] and res.stats["trainer/skipped_rows"] == 0


def _finished(table, reasons):
    import pyarrow as pa
    return table.set_column(table.schema.get_field_index("finish_reason"), "finish_reason", pa.array(reasons))


def test_replay_never_trains_an_answer_cut_off_at_max_new_tokens(digit_example):
    """A completion the sampler cut off (finish_reason "length") is unfinished: a replay does not
    reinforce it even when it beat its group (replayed again and again, such answers taught the
    policy not to stop), and "best" is the best of the finished ones. Fresh steps train every row."""
    path = f"{digit_example}/model"
    tok = load_tokenizer(path)
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2]  # positive rows: 0, 2, 4, 5
    reasons = ["length", "stop", "stop", "stop", "stop", "length", "length", "stop"]
    batch = collate(_finished(_table(tok, rewards), reasons), tok.pad_token_id)
    assert batch.truncated.tolist() == [r == "length" for r in reasons]
    tc = TrainerConfig(max_grad_norm=1e9)
    _, res = _sgd_update(path, batch, tc, rows="positive")
    assert res.rows.tolist() == [2, 4]
    _, res = _sgd_update(path, batch, tc, rows="best")
    assert res.rows.tolist() == [2, 4]  # group 0's best (row 0, 1.0) was cut off: its best finished one
    fresh, res = _sgd_update(path, batch, tc)
    assert res.rows is None and res.stats["trainer/skipped_rows"] == 0 and fresh.abs().max() > 1e-4


def test_a_replay_batch_with_no_finished_row_that_beat_its_group_makes_no_update(digit_example):
    """No optimizer step (the parameters stay), no rows, and priority 0 for every group."""
    path = f"{digit_example}/model"
    tok = load_tokenizer(path)
    table = _finished(_table(tok, [1.0, 0.0, 0.5, 0.0]), ["length", "stop", "length", "stop"])
    delta, res = _sgd_update(path, collate(table, tok.pad_token_id), TrainerConfig(), rows="positive")
    assert res.rows.numel() == 0 and res.priorities.tolist() == [0.0]
    assert delta.abs().max() == 0


def test_only_groups_with_a_finished_row_that_beat_the_group_are_replayable(digit_example):
    """What the trainer promotes to L2: with replay_rows positive or best, the groups a replay can
    train on; with all, every group."""
    tok = load_tokenizer(f"{digit_example}/model")
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2, 0.3, 0.3, 0.3, 0.3]  # group 2: no variance
    reasons = ["length", "stop", "stop", "stop", "length", "length", "stop", "stop"] + ["stop"] * 4
    batch = collate(_finished(_table(tok, rewards), reasons), tok.pad_token_id)
    assert replayable(batch, TrainerConfig()).tolist() == [True] * 4 + [False] * 8
    assert replayable(batch, TrainerConfig(replay_rows="best")).tolist() == [True] * 4 + [False] * 8
    assert replayable(batch, TrainerConfig(replay_rows="all")) is None


def test_a_replay_update_still_learns_from_rows_the_policy_has_moved_towards(digit_example):
    """Replayed rows were generated by an older policy. Once the policy has made their tokens far
    likelier than the behaviour policy did, a clip against that behaviour policy leaves them no
    gradient; a replay update (`replay_config`: the decoupled objective, whatever
    trainer.decoupled says for fresh steps) still trains on them."""
    import pyarrow as pa

    path = f"{digit_example}/model"
    tok = load_tokenizer(path)
    table = _table(tok, [1.0, 0.0, 0.5, 0.0])
    stale = pa.array([[-30.0] * len(r) for r in table.column("response_token_ids").to_pylist()],
                     pa.list_(pa.float32()))
    table = table.set_column(table.schema.get_field_index("behavior_logprobs"), "behavior_logprobs", stale)
    batch = collate(table, tok.pad_token_id)
    tc = TrainerConfig(decoupled=False)
    clipped, _ = _sgd_update(path, batch, tc, rows="positive")
    assert clipped.abs().max() == 0
    replayed, res = _sgd_update(path, batch, replay_config(tc), rows="positive")
    assert res.rows.tolist() == [0, 2] and replayed.abs().max() > 1e-4
    assert replay_config(tc).decoupled and not tc.decoupled
    assert replay_config(TrainerConfig(decoupled=True)).decoupled
