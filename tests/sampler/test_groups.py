"""`sampler.oversample`: which of a batch's groups are handed over, and which archived."""

from pipeline.data import PromptRow
from pipeline.sampler.groups import most_varied, spread
from pipeline.scoring import BatchScores, Score


def _batch(rewards_per_group):
    batch = [PromptRow(f"p{i}", "s", "x", "", None) for i in range(len(rewards_per_group))]
    ids = [[i] for i in range(len(rewards_per_group))]
    groups = [[f"c{i}.{j}" for j in range(len(r))] for i, r in enumerate(rewards_per_group)]
    scores = [Score(reward=x) for r in rewards_per_group for x in r]
    return batch, ids, groups, BatchScores(scores, errors=1, timeouts=0, extra_means={"acc": 0.5})


def test_the_groups_whose_rewards_vary_most_are_kept_in_batch_order_with_their_scores():
    rewards = [[1, 1, 1, 1], [0, 1, 0, 1], [0.2, 0.3, 0.2, 0.3], [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 1]]
    (batch, ids, groups, scores), left = most_varied(*_batch(rewards), keep=3)
    assert [p.prompt_id for p in batch] == ["p1", "p4", "p5"]  # spreads 0.5, 0.43, 0.5; ties: the earlier first
    assert ids == [[1], [4], [5]] and groups == [["c1.0", "c1.1", "c1.2", "c1.3"], ["c4.0", "c4.1", "c4.2", "c4.3"],
                                                  ["c5.0", "c5.1", "c5.2", "c5.3"]]
    assert [s.reward for s in scores.scores] == [0, 1, 0, 1, 1, 0, 0, 0, 0, 1, 0, 1]
    assert scores.errors == 1 and scores.extra_means == {"acc": 0.5}
    # the others, for the archive, in the batch's order with their own scores
    batch, ids, groups, scores = left
    assert [p.prompt_id for p in batch] == ["p0", "p2", "p3"] and ids == [[0], [2], [3]]
    assert groups == [[f"c{i}.{j}" for j in range(4)] for i in (0, 2, 3)]
    assert [s.reward for s in scores.scores] == [1, 1, 1, 1, 0.2, 0.3, 0.2, 0.3, 0, 0, 0, 0]
    (batch, _, _, _), left = most_varied(*_batch(rewards), keep=2)
    assert [p.prompt_id for p in batch] == ["p1", "p5"] and [p.prompt_id for p in left[0]] == ["p0", "p2", "p3", "p4"]


def test_a_batch_of_no_more_groups_than_kept_is_handed_over_as_it_is():
    whole = _batch([[0, 0], [1, 0]])
    assert most_varied(*whole, keep=2) == (whole, None)
    assert spread([3.0]) == 0.0 and spread([0, 1]) == 0.5
