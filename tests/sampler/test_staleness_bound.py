"""The sampler's staleness bound counts a batch's last group: a batch of several steps' groups is
trained over all of those steps."""

from pipeline.config import parse_config
from pipeline.sampler.loop import batch_ahead, scheduled_version


def test_a_batch_of_several_steps_is_as_stale_as_its_last_group():
    # 16 groups per step, a batch of 64 after 32 committed groups: its groups are trained at steps 2..5
    assert batch_ahead(32, 16, policy_version=2, groups=64) == 3
    assert batch_ahead(32, 16, policy_version=2, groups=16) == 0  # one step's batch: as before
    assert batch_ahead(32, 16, policy_version=2, groups=8) == 0  # half a step's: trained at step 2


def test_a_fixed_lag_schedules_the_version_the_bound_admits_for_the_batchs_last_group():
    cfg = parse_config({"trainer": {"groups_per_step": 16, "sync_every": 1},
                        "sampler": {"prompts_per_batch": 32, "max_staleness": 1, "fixed_lag": True}})
    # the batch after 64 groups is trained at steps 4 and 5: the oldest version within 1 of step 5 is v4
    assert scheduled_version(cfg, 64) == 4
