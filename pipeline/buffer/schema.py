"""The rollout record: a versioned Arrow schema shared by sampler, buffer and trainer.

One row is one completion. Rows of the same prompt share `group_id` (the GRPO group); a shard
always holds whole groups. The schema version is stored in the Parquet metadata of every shard; a
reader refuses shards from a newer major version with a clear error.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = b"rlhf.rollout_schema_version"

ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("data_source", pa.string(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_text", pa.string(), nullable=False),
        pa.field("behavior_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("token_rewards", pa.list_(pa.float32()), nullable=True),
        pa.field("reward_extra", pa.string(), nullable=True),  # JSON of the reward dict's other keys
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("sampler_id", pa.string(), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("content_hash", pa.string(), nullable=False),
        # bookkeeping of the buffer (initial values; updates go to the buffer's logs, never the shard)
        pa.field("tier", pa.string(), nullable=False),
        pa.field("replay_count", pa.int32(), nullable=False),
        pa.field("priority", pa.float32(), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)


class SchemaError(ValueError):
    """A shard whose schema this version cannot read."""


def content_hash(prompt_token_ids: list[int], response_token_ids: list[int]) -> str:
    """Dedup key: same prompt and same response tokens give the same hash."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(prompt_token_ids).encode())
    h.update(b"|")
    h.update(repr(response_token_ids).encode())
    return h.hexdigest()


def to_table(rows: list[dict]) -> pa.Table:
    """Rows (dicts with the schema's columns) -> a table with the exact rollout schema."""
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


def check_schema(schema: pa.Schema, where: str) -> None:
    """Raise SchemaError unless `schema` is a rollout schema this code can read."""
    meta = schema.metadata or {}
    raw = meta.get(SCHEMA_VERSION_KEY)
    if raw is None:
        raise SchemaError(f"{where}: not a rollout shard (no {SCHEMA_VERSION_KEY.decode()} metadata)")
    version = int(raw)
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"{where}: written with rollout schema v{version}, this installation reads up to "
            f"v{SCHEMA_VERSION}; upgrade rlhf-pipeline to read this buffer"
        )
    missing = [f.name for f in ROLLOUT_SCHEMA if f.name not in schema.names]
    if missing:
        raise SchemaError(f"{where}: missing rollout columns {missing}")
