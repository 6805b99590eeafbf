"""`trainer.borrow_threads`: a fresh step takes the samplers' CPU threads once every sampler is held
by the staleness bound (it waits for the policy this step publishes), and gives them back when the
step ends. Which micro-batches run with them is decided before each one (`train_step`'s hook)."""

from __future__ import annotations

import pytest
import torch
from trainer_rollouts import rollout_table

from pipeline.config import TrainerConfig
from pipeline.models import load_model, load_tokenizer
from pipeline.trainer.batch import collate
from pipeline.trainer.critic import ActorCritic
from pipeline.trainer.borrow import BorrowedThreads
from pipeline.trainer.step import train_step

GROUPS = 4  # groups per step


class Feed:
    def __init__(self):
        self.next_step_read = False

    def ready(self) -> bool:
        return self.next_step_read


class Buffer:
    def __init__(self, committed: int):
        self.committed, self.reads = committed, 0

    def committed_groups(self) -> int:
        self.reads += 1
        return self.committed


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_with_a_bound_of_one_the_threads_come_once_the_next_steps_groups_are_read(threads):
    feed = Feed()
    lend = BorrowedThreads(1, 1, staleness=1, groups_per_step=GROUPS, feed=feed, buffer=Buffer(0))
    lend.start(step=5)
    seen = []
    for mb in range(4):
        feed.next_step_read = mb == 2  # the sampler commits step 6's groups during micro-batch 1
        lend()
        seen.append(torch.get_num_threads())
    assert seen == [1, 1, 2, 2]  # and kept once taken: the sampler stays held until this step publishes
    assert lend.end() == 0.5 and torch.get_num_threads() == 1
    lend.start(step=6)
    feed.next_step_read = False
    lend()
    assert torch.get_num_threads() == 1 and lend.end() == 0.0  # a new step starts with its own threads


def test_on_policy_samplers_are_always_held_while_the_trainer_steps(threads):
    lend = BorrowedThreads(1, 1, staleness=0, groups_per_step=GROUPS, feed=Feed(), buffer=Buffer(0))
    lend.start(step=0)
    lend()
    assert torch.get_num_threads() == 2 and lend.end() == 1.0 and torch.get_num_threads() == 1


def test_with_a_wider_bound_a_count_of_the_log_says_whether_every_sampler_is_held(threads):
    feed, buffer = Feed(), Buffer(committed=(5 + 2) * GROUPS)  # steps 0..6 committed: step 7 may still come
    lend = BorrowedThreads(1, 1, staleness=2, groups_per_step=GROUPS, feed=feed, buffer=buffer, recount_s=3600)
    lend.start(step=5)
    lend()
    assert buffer.reads == 0  # not before the read ahead has the next step's groups
    feed.next_step_read = True
    lend()
    lend()
    assert buffer.reads == 1 and torch.get_num_threads() == 1  # read at most every recount_s
    assert lend.end() == 0.0
    lend.recount_s = 0.0
    lend.start(step=5)
    lend()
    assert buffer.reads == 2 and torch.get_num_threads() == 1
    buffer.committed = (5 + 3) * GROUPS  # step 7's groups too: version 5 + 2 = 7 would make the next batch
    lend()
    assert buffer.reads == 3 and torch.get_num_threads() == 2
    lend()
    assert buffer.reads == 3  # taken: no more counting this step
    assert lend.end() == 2 / 3 and torch.get_num_threads() == 1


def test_train_step_asks_before_every_micro_batch_of_every_update_epoch(digit_example):
    model = load_model(f"{digit_example}/model").train()
    tok = load_tokenizer(f"{digit_example}/model")
    batch = collate(rollout_table(tok, [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2]), tok.pad_token_id)
    tc = TrainerConfig(micro_batch_tokens=int(batch.lengths.max()) * 3, update_epochs=2, share_prompts=False)
    calls = []
    res = train_step(ActorCritic(model), None, torch.optim.SGD(model.parameters(), lr=0.1), batch, tc,
                     temperature=1.0, before_micro_batch=lambda: calls.append(1))
    assert res.stats["trainer/micro_batches"] == 3
    assert len(calls) == 2 * 3
