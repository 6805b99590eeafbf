import math

import torch

from pipeline.trainer.advantages import ADVANTAGES, grpo_advantages
from pipeline.trainer.losses import aggregate, clipped_policy_loss, kl_k3


def test_grpo_advantage_matches_hand_computation():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = grpo_advantages(r, g, std_normalize=True)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std(unbiased=True).item()  # 0.57735
    assert math.isclose(adv[0].item(), 0.5 / (std + 1e-6), rel_tol=1e-5)
    assert math.isclose(adv[1].item(), -0.5 / (std + 1e-6), rel_tol=1e-5)
    assert adv[4].item() == 0.0 and adv[5].item() == 0.0  # no variance, no signal


def test_grpo_without_std_normalisation_is_centred_reward():
    r = torch.tensor([3.0, 1.0])
    adv = grpo_advantages(r, torch.tensor([0, 0]), std_normalize=False)
    assert adv.tolist() == [1.0, -1.0]


def test_a_group_whose_rewards_are_all_equal_gets_exactly_zero_advantage():
    """0.7 * 8 / 8 is not 0.7 in float32: the std normalisation used to turn that ulp into an
    advantage of 0.056 for every completion of the group."""
    r = torch.tensor([0.7] * 8 + [0.1] * 8 + [1 / 3] * 8 + [0.6] * 7 + [0.7])
    g = torch.arange(32) // 8
    for name in ("grpo", "dr_grpo", "rloo"):
        adv = ADVANTAGES[name](r, g)
        assert torch.equal(adv[:24], torch.zeros(24)), (name, adv)
        assert (adv[24:31] < 0).all() and adv[31] > 0, (name, adv)


def test_clipped_loss_on_policy_equals_minus_advantage_mean():
    lp = torch.tensor([[-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = clipped_policy_loss(lp, lp.clone(), torch.tensor([2.0]), mask, clip_eps=0.2)
    assert math.isclose(loss.item(), -2.0, rel_tol=1e-6)
    assert stats["actor/ratio_mean"] == 1.0 and stats["actor/clip_frac"] == 0.0


def test_clipped_loss_hand_values():
    # ratio e^0.5 = 1.6487 on token 0 with A = +1 -> clipped to 1.2; ratio e^-0.5 = 0.6065 on token 1
    # with A = +1 -> unclipped 0.6065 is the minimum. Loss = -(1.2 + 0.6065) / 2.
    lp = torch.tensor([[0.5, -0.5]])
    blp = torch.zeros(1, 2)
    loss, stats = clipped_policy_loss(lp, blp, torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2)
    assert math.isclose(loss.item(), -(1.2 + math.exp(-0.5)) / 2, rel_tol=1e-5)
    assert stats["actor/clip_frac"] == 0.5


def test_clipped_loss_negative_advantage_hand_values():
    # A = -1: token 0 ratio e^0.5 -> -min(-1.6487, -1.2) = 1.6487; token 1 ratio e^-0.5 -> min(-0.6065, -0.8) -> 0.8
    lp = torch.tensor([[0.5, -0.5]])
    loss, _ = clipped_policy_loss(lp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), clip_eps=0.2)
    assert math.isclose(loss.item(), (math.exp(0.5) + 0.8) / 2, rel_tol=1e-5)


def test_aggregation_modes_differ_as_defined():
    x = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert math.isclose(aggregate(x, mask, "token-mean").item(), 7.0 / 4)
    assert math.isclose(aggregate(x, mask, "seq-mean-token-mean").item(), (1.0 + 4.0) / 2)


def test_k3_kl_is_zero_for_identical_policies_and_positive_otherwise():
    lp = torch.tensor([-1.0, -2.0])
    assert torch.allclose(kl_k3(lp, lp), torch.zeros(2))
    d = 0.3
    assert math.isclose(kl_k3(torch.tensor([0.0]), torch.tensor([d])).item(), math.exp(d) - d - 1, rel_tol=1e-6)


def test_as_a_loss_k2_pulls_toward_the_reference_with_the_gradient_of_kl_pi_ref_and_k3_of_kl_ref_pi():
    """The expected gradient over tokens drawn from pi (arXiv 2506.09477), exactly, on one categorical."""
    from pipeline.trainer.losses import KL_ESTIMATORS

    torch.manual_seed(0)
    theta = torch.randn(6, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6), -1)

    def expected_grad(f):
        logp = torch.log_softmax(theta, -1)
        return torch.autograd.grad((logp.exp().detach() * f(logp, ref)).sum(), theta)[0]

    def grad_of(kl):
        return torch.autograd.grad(kl(torch.log_softmax(theta, -1)), theta)[0]

    reverse = grad_of(lambda lp: (lp.exp() * (lp - ref)).sum())    # KL(pi || ref)
    forward = grad_of(lambda lp: (ref.exp() * (ref - lp)).sum())    # KL(ref || pi)
    assert torch.allclose(expected_grad(KL_ESTIMATORS["k2"]), reverse, atol=1e-6)
    assert torch.allclose(expected_grad(KL_ESTIMATORS["k3"]), forward, atol=1e-6)
    assert torch.allclose(expected_grad(KL_ESTIMATORS["k1"]), torch.zeros(6), atol=1e-6)
