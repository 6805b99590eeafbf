"""Advantages, importance weights and the decoupled loss against hand-computed values."""

import math

import pytest
import torch

from pipeline.trainer.advantages import ADVANTAGES, gae, token_rewards, vtrace
from pipeline.trainer.algorithms import ALGORITHMS, get_algorithm
from pipeline.trainer.losses import aggregate, is_weights, kl_k1, policy_loss


def test_rloo_is_reward_minus_mean_of_the_others():
    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    adv = ADVANTAGES["rloo"](r, g)
    assert torch.allclose(adv, torch.tensor([1 - 0.25, 0 - 0.75, 0.5 - 0.5, 2 - 4.0, 4 - 2.0]))


def test_dr_grpo_is_centred_reward_and_reinforce_pp_whitens_over_the_batchs_response_tokens():
    r = torch.tensor([1.0, 0.0, 3.0, 1.0])
    g = torch.tensor([0, 0, 1, 1])
    assert ADVANTAGES["dr_grpo"](r, g).tolist() == [0.5, -0.5, 1.0, -1.0]
    # verl's REINFORCE++-baseline: the centred value on each response token, whitened over all of them
    lengths = torch.tensor([3, 20, 4, 30])
    c = torch.tensor([0.5, -0.5, 1.0, -1.0])
    tokens = torch.repeat_interleave(c, lengths)
    expected = (c - tokens.mean()) * torch.rsqrt(tokens.var(unbiased=True) + 1e-8)
    adv = ADVANTAGES["reinforce_pp"](r, g, response_tokens=lengths)
    assert torch.allclose(adv, expected)
    assert not torch.allclose(adv / adv.abs().max(), c / c.abs().max())  # not Dr. GRPO rescaled


def test_every_registered_algorithm_is_a_config_choice():
    from pipeline.config import TrainerConfig

    allowed = set(TrainerConfig.model_fields["algorithm"].annotation.__args__)
    assert allowed == set(ALGORITHMS)
    assert get_algorithm("ppo").critic and not get_algorithm("grpo").critic
    with pytest.raises(ValueError, match="trainer.algorithm"):
        get_algorithm("a2c")


def test_gae_hand_values():
    # one sequence, response at positions 1..3, reward 1 on the last token, gamma 1, lambda 0.5
    mask = torch.tensor([[0.0, 1, 1, 1]])
    v = torch.tensor([[0.0, 0.2, 0.4, 0.6]])
    r = token_rewards(torch.tensor([1.0]), mask)
    assert r.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    adv, ret = gae(v, r, mask, gamma=1.0, lam=0.5)
    d3 = 1.0 - 0.6          # 0.4
    d2 = 0.0 + 0.6 - 0.4    # 0.2
    d1 = 0.0 + 0.4 - 0.2    # 0.2
    a3 = d3
    a2 = d2 + 0.5 * a3      # 0.4
    a1 = d1 + 0.5 * a2      # 0.4
    assert torch.allclose(adv, torch.tensor([[0.0, a1, a2, a3]]))
    assert torch.allclose(ret, torch.tensor([[0.0, a1 + 0.2, a2 + 0.4, a3 + 0.6]]))


def test_vtrace_targets_on_policy_equal_gae_returns():
    torch.manual_seed(0)
    mask = torch.tensor([[0.0, 1, 1, 1, 1, 0], [0.0, 0, 1, 1, 0, 0]])
    v = torch.randn(2, 6) * mask
    r = token_rewards(torch.tensor([0.7, -0.3]), mask)
    _, gae_ret = gae(v, r, mask, gamma=0.9, lam=0.8)
    _, vt = vtrace(v, r, mask, torch.zeros(2, 6), gamma=0.9, lam=0.8, rho_bar=1.0, c_bar=1.0)
    assert torch.allclose(vt, gae_ret, atol=1e-6)


def test_vtrace_truncates_rho_and_c_by_hand():
    # two response tokens; pi/mu = 3 at t=1 (truncated to rho_bar=1, c = lam*c_bar = 1), 0.5 at t=2
    mask = torch.tensor([[0.0, 1, 1]])
    v = torch.tensor([[0.0, 0.5, 0.25]])
    r = torch.tensor([[0.0, 0.0, 1.0]])
    log_rho = torch.tensor([[0.0, math.log(3.0), math.log(0.5)]])
    adv, tgt = vtrace(v, r, mask, log_rho, gamma=1.0, lam=1.0, rho_bar=1.0, c_bar=1.0)
    d2 = 0.5 * (1.0 - 0.25)          # rho_2 = 0.5
    v2 = 0.25 + d2                    # 0.625
    d1 = 1.0 * (0.0 + 0.25 - 0.5)     # rho_1 = min(1, 3)
    v1 = 0.5 + d1 + 1.0 * (v2 - 0.25)  # c_1 = min(1, 3)
    assert torch.allclose(tgt, torch.tensor([[0.0, v1, v2]]))
    # policy-gradient advantages before the IS factor the loss applies: r + v_{t+1} - V_t
    assert torch.allclose(adv, torch.tensor([[0.0, 0.0 + v2 - 0.5, 1.0 - 0.25]]))


def test_is_weights_token_and_sequence_truncation_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    prox = torch.tensor([[math.log(3.0), math.log(0.5), 7.0]])
    mu = torch.zeros(1, 3)
    w, raw = is_weights(prox, mu, mask, "token", clip=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0]]))
    assert torch.allclose(raw, torch.tensor([[3.0, 0.5, 1.0]]))
    w, raw = is_weights(prox, mu, mask, "sequence", clip=2.0)  # product 1.5 < C
    assert torch.allclose(w[0, :2], torch.tensor([1.5, 1.5]))
    w, _ = is_weights(prox, mu, mask, "sequence", clip=1.2)
    assert torch.allclose(w[0, :2], torch.tensor([1.2, 1.2]))
    w, _ = is_weights(prox, mu, mask, "none", clip=1.2)
    assert torch.equal(w, torch.ones(1, 3))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_identical_behaviour_and_current_policy_gives_weights_of_exactly_one(level):
    torch.manual_seed(1)
    lp = -torch.rand(4, 7) * 3
    mask = (torch.rand(4, 7) > 0.3).float()
    w, raw = is_weights(lp, lp.clone(), mask, level, clip=2.0)
    assert torch.equal(w, torch.ones_like(w)) and torch.equal(raw, torch.ones_like(raw))
    per_tok, s = policy_loss(lp.clone().requires_grad_(), lp, lp.clone(), torch.randn(4), mask, is_level=level)
    assert s["is_sum"] == s["tokens"] and s["is_max"] == 1.0 and s["is_clipped"] == 0.0


def test_stale_data_weights_with_corrections_on_and_off():
    """A token the sampler found 4x less likely than the trainer does now: the decoupled loss weighs
    its surrogate by min(4, C); the coupled loss uses the raw ratio and clips it at 1 + eps."""
    mask = torch.ones(1, 1)
    cur = torch.tensor([[math.log(0.8)]], requires_grad=True)
    mu = torch.tensor([[math.log(0.2)]])
    adv = torch.tensor([1.0])
    on, s_on = policy_loss(cur, cur.detach(), mu, adv, mask, clip_eps=0.2, decoupled=True, is_level="token", is_clip=2.0)
    assert math.isclose(on.item(), -2.0, rel_tol=1e-6)           # -min(4, C=2) * ratio 1 * A
    assert s_on["is_clipped"] == 1.0 and math.isclose(s_on["is_max"], 4.0, rel_tol=1e-5)
    on.sum().backward()
    assert math.isclose(cur.grad.item(), -2.0, rel_tol=1e-5)      # d/dlogp of -w e^(logp - prox) A at prox = logp
    off, s_off = policy_loss(cur.detach(), cur.detach(), mu, adv, mask, clip_eps=0.2, decoupled=False)
    assert math.isclose(off.item(), -1.2, rel_tol=1e-6)           # ratio 4 clipped to 1.2
    assert s_off["clip_sum"] == 1.0


def test_decoupled_loss_clips_against_the_proximal_policy():
    # current drifted from proximal by ratio e^0.5 (A > 0): clipped to 1.2, times w = pi_prox/mu = 1
    mask = torch.ones(1, 1)
    prox = torch.tensor([[-1.0]])
    cur = prox + 0.5
    per, s = policy_loss(cur, prox, prox.clone(), torch.tensor([1.0]), mask, clip_eps=0.2, decoupled=True)
    assert math.isclose(per.item(), -1.2, rel_tol=1e-6) and s["clip_sum"] == 1.0


def test_k1_is_the_log_ratio_and_aggregation_of_weighted_losses():
    assert torch.allclose(kl_k1(torch.tensor([-1.0]), torch.tensor([-1.5])), torch.tensor([0.5]))
    x = torch.tensor([[2.0, 2.0], [1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w = torch.tensor([[0.5], [1.0]])  # prioritized-replay weights per sample
    assert math.isclose(aggregate(x * w, mask, "token-mean").item(), (1 + 1 + 1) / 3)
