"""The tiered replay buffer: rollout shards on shared storage, committed through a create-only log.

See `buffer.py` for the API, `log.py` for the commit protocol and `state.py` for what the log holds.
"""

from .buffer import ReplayBuffer, parse_cursor
from .log import CommitConflict, CommitLog
from .shards import CorruptShard
from .writer import ShardWriter

__all__ = ["ReplayBuffer", "ShardWriter", "CommitLog", "CommitConflict", "CorruptShard", "parse_cursor"]
