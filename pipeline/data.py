"""Prompt datasets in verl's column layout, validated before anything expensive happens.

Required columns: `data_source`, `prompt` (list of chat messages or a string),
`reward_model.ground_truth`. Optional: `ability`, `extra_info` (a struct/dict).
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from .config import ConfigError
from .storage import put_atomic, url_to_fs

REQUIRED = ("data_source", "prompt", "reward_model.ground_truth")


@dataclass(frozen=True)
class PromptRow:
    prompt_id: str
    data_source: str
    messages: list | str
    ground_truth: str
    extra_info: dict | None


def _read_table(url: str, field: str) -> pa.Table:
    fs, path = url_to_fs(url)
    if not fs.exists(path):
        raise ConfigError(f"{field}: dataset {url!r} not found; give a Parquet file in verl's column layout")
    try:
        # From bytes, not a Python file object: pyarrow 26 can abort at interpreter exit after
        # reading through a Python file object.
        return pq.read_table(pa.BufferReader(fs.cat_file(path)))
    except (pa.ArrowInvalid, OSError) as e:
        raise ConfigError(f"{field}: {url!r} is not a readable Parquet file ({e})") from None


def validate_columns(table: pa.Table, url: str, field: str) -> None:
    names = set(table.column_names)
    for col in REQUIRED:
        top, _, sub = col.partition(".")
        ok = top in names
        if ok and sub:
            t = table.schema.field(top).type
            ok = pa.types.is_struct(t) and t.get_field_index(sub) >= 0
        if not ok:
            raise ConfigError(
                f"{field}: dataset {url!r} lacks column '{col}'; verl format needs "
                f"{', '.join(REQUIRED)} (found: {', '.join(sorted(names))})"
            )
    if table.num_rows == 0:
        raise ConfigError(f"{field}: dataset {url!r} has no rows")


def prompt_id_of(row: dict, index: int) -> str:
    body = json.dumps([row["data_source"], row["prompt"], index], sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def load_prompts(url: str, field: str = "data.train", limit: int | None = None) -> list[PromptRow]:
    table = _read_table(url, field)
    validate_columns(table, url, field)
    if limit is not None:
        table = table.slice(0, limit)
    rows = []
    for i, r in enumerate(table.to_pylist()):
        rows.append(PromptRow(
            prompt_id=prompt_id_of(r, i),
            data_source=str(r["data_source"]),
            messages=r["prompt"],
            ground_truth=str(r["reward_model"]["ground_truth"]),
            extra_info=r.get("extra_info"),
        ))
    return rows


def stage(src_url: str, dst_fs, dst_path: str, field: str, limit: int | None = None) -> int:
    """Validate the dataset at `src_url` and publish a copy into the run directory. Returns rows."""
    table = _read_table(src_url, field)
    validate_columns(table, src_url, field)
    if limit is not None:
        table = table.slice(0, limit)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    put_atomic(dst_fs, dst_path, buf.getvalue())
    return table.num_rows


def write_rows(rows: list[dict], url: str) -> None:
    fs, path = url_to_fs(url)
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf, compression="zstd")
    put_atomic(fs, path, buf.getvalue())
