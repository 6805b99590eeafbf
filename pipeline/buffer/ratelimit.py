"""Flow control for the sampler: wait instead of producing rollouts nobody will train on.

Three bounds, each off unless configured (`BufferConfig`):

- `samples_per_insert` (as in Reverb): inserts are L1 groups committed, samples are groups the
  trainer used (fresh groups consumed + L2 replays). The sampler may insert while
  `(inserts + n) * spi - samples <= rate_error_groups * spi`, so over time every inserted group is
  sampled about `spi` times.
- `max_fresh_backlog`: at most this many L1 groups committed and not yet consumed.
- `l1_max_rows`: at most this many rows of L1 not yet consumed (the shard the consumer is in counts
  whole); L1 never drops them, the sampler waits for the trainer instead. Consumed shards stay in L1
  until compaction archives them into L3 (the run's finalize, or `rlhf buffer compact`), so a long
  run never waits on a compaction nothing runs while it trains.

Consumption is what the trainer records in the log (`promote(..., cursor=...)` or
`mark_consumed`); a trainer that records nothing makes the first two bounds block for ever, which is
why the wait names the bound and the numbers. With either of them set the trainer records it after
every step, else every few seconds (`bounds_consumer_progress`). Staleness (policy versions) is bounded by the
sampler itself, where the versions are known.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .buffer import ReplayBuffer


def bounds_consumer_progress(cfg) -> bool:
    """Whether a bound of `cfg` (a BufferConfig) reads the consumer's progress from the log
    (`samples_per_insert`, `max_fresh_backlog`): the trainer then records its consumption after
    every step, and a lone sampler reads the log before every batch."""
    return cfg.samples_per_insert is not None or cfg.max_fresh_backlog is not None


class RateLimiter:
    def __init__(self, buffer: "ReplayBuffer", consumer: str = "trainer"):
        self.buffer = buffer
        self.consumer = consumer

    def blocked_by(self, groups: int, refresh: bool = True) -> str | None:
        """Why inserting `groups` more groups must wait now, or None if it may go ahead (`refresh`
        False: judged on the state of this process's last refresh)."""
        with self.buffer.current_state(refresh) as st:
            return self._blocked_by(groups, st)

    def _blocked_by(self, groups: int, st) -> str | None:
        cfg = self.buffer.config
        inserted = st.l1_groups_added
        consumed = int(st.consumed.get(self.consumer, {}).get("groups", 0))
        if cfg.samples_per_insert is not None:
            spi = cfg.samples_per_insert
            samples = consumed + st.replays_done
            if (inserted + groups) * spi - samples > cfg.rate_error_groups * spi:
                return (f"samples_per_insert={spi}: {inserted} groups inserted, {samples} sampled "
                        f"(slack {cfg.rate_error_groups} groups)")
        if cfg.max_fresh_backlog is not None and inserted - consumed + groups > cfg.max_fresh_backlog:
            return f"max_fresh_backlog={cfg.max_fresh_backlog}: {inserted - consumed} groups not yet consumed"
        l1_rows = _unconsumed_l1_rows(st, self.consumer)
        if l1_rows >= cfg.l1_max_rows:
            return f"l1_max_rows={cfg.l1_max_rows}: L1 holds {l1_rows} rows not yet consumed; waiting for the trainer"
        return None

    def l1_full(self) -> bool:
        """Whether the `l1_max_rows` bound holds inserts, as of this process's last refresh (no
        request): until the consumer records that it read on."""
        with self.buffer.current_state(False) as st:
            return _unconsumed_l1_rows(st, self.consumer) >= self.buffer.config.l1_max_rows

    def wait_to_insert(self, groups: int, timeout_s: float | None = None, poll_s: float = 0.2,
                       should_stop: Callable[[], bool] | None = None) -> float:
        """Block until `groups` more groups may be inserted (or `should_stop()`); returns seconds
        waited. Raises TimeoutError naming the bound after `timeout_s`."""
        t0 = time.monotonic()
        while True:
            reason = self.blocked_by(groups)
            if reason is None or (should_stop is not None and should_stop()):
                return time.monotonic() - t0
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"buffer {self.buffer.url}: sampler waited {timeout_s:.0f}s on {reason}")
            time.sleep(poll_s)


def _unconsumed_l1_rows(st, consumer: str) -> int:
    """Rows of the L1 shards from the one `consumer`'s recorded cursor is in (all of them before it
    records one)."""
    cursor = st.consumed.get(consumer)
    first = int(cursor["seq"]) if cursor is not None else -1
    return sum(st.shards[st.l1_by_seq[s]].rows for s in st.l1_seqs if s >= first)
