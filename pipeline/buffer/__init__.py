"""The tiered replay buffer: rollout shards on shared storage, committed through a create-only log.

    buffer/
      _log/            numbered create-only entries + periodic checkpoints (log.py, logfiles.py;
                       the actions they hold: actions.py; the state they give: state.py)
      l1/              fresh shards, one per sampler batch (writer.py)
      l2/              promoted groups for replay (promotion.py, replay.py)
      l3/run=<id>/     archive: part-*.parquet of up to compact_target_rows rows (archive.py)

Tiers and their bounds (BufferConfig):

- L1 hot: every group consumed once, in commit order, from a cursor the trainer checkpoints
  (`read_fresh`). Bound `l1_max_rows` on the rows not yet consumed: never dropped — the rate
  limiter (ratelimit.py) makes the sampler wait instead. Consumed shards leave L1 by compaction
  into L3 (`compact`: the run's finalize, or the CLI), none past the cursor of the trainer's
  newest checkpoint (`mark_resumable`), which a restarted trainer reads from again.
- L2 warm: consumed groups that pass the quality filter (`promote`), drawn by proportional
  prioritized replay with importance weights (`sample_replay`, `update_priorities`) up to
  `max_replays_per_group` times. Bound `l2_max_groups`: shards whose groups used up their replays
  leave first, then the oldest shards (FIFO). L2 holds copies; the archive is built from L1, and
  from the groups a sampler did not hand over (`sampler.oversample`), in small files of their own.
- L3 cold: zstd files partitioned by run, rows ordered by policy version; `compact` merges them
  into large ones and applies the bounds `l3_retention_s` and `l3_max_rows`: the oldest files are
  dropped first.

Bad shards are quarantined (kept on storage, listed by `stats` and `verify`); `vacuum` removes
orphans after `orphan_grace_s`. See buffer.py for the API.
"""

from .actions import AddShard, LogEntry, MarkConsumed, Quarantine, RecordReplays, RemoveShard
from .buffer import ReplayBuffer, parse_cursor
from .log import CommitConflict, CommitLog
from .ratelimit import RateLimiter, bounds_consumer_progress
from .replay import ReplayBatch
from .shards import CorruptShard
from .writer import ShardWriter

__all__ = ["ReplayBuffer", "ShardWriter", "ReplayBatch", "RateLimiter", "bounds_consumer_progress", "CommitLog",
           "CommitConflict", "CorruptShard", "parse_cursor", "AddShard", "RemoveShard", "RecordReplays", "MarkConsumed",
           "Quarantine", "LogEntry"]
