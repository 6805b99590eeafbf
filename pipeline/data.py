"""Prompt datasets in verl's column layout, validated before anything expensive happens.

Required columns: `data_source`, `prompt` (list of chat messages or a string),
`reward_model.ground_truth`. Optional: `ability`, `extra_info` (a struct/dict).

`ground_truth` and `extra_info` keep the type the Parquet column gives them: a string, a number,
a list (Arrow list column) or a dict (Arrow struct column), and reach the reward function as such.
A ground truth stored as a JSON string stays a string: the reward function decodes it, as in verl.
"""

from __future__ import annotations

import hashlib
import io
import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from .config import ConfigError
from .locations import reaching
from .storage import parquet_from_bytes, put_atomic, url_to_fs

REQUIRED = ("data_source", "prompt", "reward_model.ground_truth")


@dataclass(frozen=True)
class PromptRow:
    prompt_id: str
    data_source: str
    messages: list | str
    ground_truth: Any  # as the dataset holds it: str, number, list or dict
    extra_info: dict | None


def _read_table(url: str, field: str) -> pa.Table:
    with reaching(field, url):
        fs, path = url_to_fs(url)
        if not fs.exists(path):
            raise ConfigError(f"{field}: dataset {url!r} not found; give a Parquet file in verl's column layout")
        data = fs.cat_file(path)
    try:
        return parquet_from_bytes(data)
    except (pa.ArrowInvalid, OSError) as e:
        raise ConfigError(f"{field}: {url!r} is not a readable Parquet file ({e})") from None


@contextmanager
def _parquet_file(url: str, field: str) -> Iterator[pq.ParquetFile]:
    """The dataset opened for reading parts of it (its schema, a column, the first rows)."""
    with reaching(field, url):
        fs, path = url_to_fs(url)
        if not fs.exists(path):
            raise ConfigError(f"{field}: dataset {url!r} not found; give a Parquet file in verl's column layout")
        f = fs.open(path, "rb")
    with f:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowInvalid, OSError) as e:
            raise ConfigError(f"{field}: {url!r} is not a readable Parquet file ({e})") from None
        yield pf


def validate_columns(table: pa.Table, url: str, field: str) -> None:
    validate_schema(table.schema, table.num_rows, url, field)


def validate_schema(schema: pa.Schema, num_rows: int, url: str, field: str) -> None:
    names = set(schema.names)
    for col in REQUIRED:
        top, _, sub = col.partition(".")
        ok = top in names
        if ok and sub:
            t = schema.field(top).type
            ok = pa.types.is_struct(t) and t.get_field_index(sub) >= 0
        if not ok:
            raise ConfigError(
                f"{field}: dataset {url!r} lacks column '{col}'; verl format needs "
                f"{', '.join(REQUIRED)} (found: {', '.join(sorted(names))})"
            )
    if num_rows == 0:
        raise ConfigError(f"{field}: dataset {url!r} has no rows")


def data_sources(url: str, field: str) -> set[str]:
    """The distinct `data_source` values of a dataset (that one column is read)."""
    with _parquet_file(url, field) as pf:
        validate_schema(pf.schema_arrow, pf.metadata.num_rows, url, field)
        return {str(s) for s in pf.read(columns=["data_source"], use_threads=False).column(0).unique().to_pylist()}


def prompt_id_of(row: dict, index: int) -> str:
    body = json.dumps([row["data_source"], row["prompt"], index], sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def load_prompts(url: str, field: str = "data.train", limit: int | None = None) -> list[PromptRow]:
    """The dataset's prompts; with `limit`, its first rows only, read without the rest (checking
    a dataset of millions of rows reads its schema and one batch, not the whole file)."""
    if limit is None:
        table = _read_table(url, field)
        validate_columns(table, url, field)
    else:
        with _parquet_file(url, field) as pf:
            validate_schema(pf.schema_arrow, pf.metadata.num_rows, url, field)
            table = pa.Table.from_batches([next(pf.iter_batches(batch_size=max(limit, 1), use_threads=False))])
        table = table.slice(0, limit)
    rows = []
    for i, r in enumerate(table.to_pylist()):
        rows.append(PromptRow(
            prompt_id=prompt_id_of(r, i),
            data_source=str(r["data_source"]),
            messages=r["prompt"],
            ground_truth=r["reward_model"]["ground_truth"],
            extra_info=r.get("extra_info"),
        ))
    return rows


def filter_overlong(prompts: list[PromptRow], tokenizer, max_tokens: int, policy: str = "filter",
                    field: str = "data.train") -> tuple[list[PromptRow], int]:
    """Prompts whose rendered text is at most `max_tokens` tokens, and how many were longer.

    policy `filter` drops the longer ones (verl's `filter_overlong_prompts`); `fail` raises a
    ConfigError naming the first one."""
    from .models import prompt_token_ids

    kept: list[PromptRow] = []
    for start in range(0, len(prompts), 1024):
        chunk = prompts[start:start + 1024]
        ids = prompt_token_ids(tokenizer, [p.messages for p in chunk])
        for p, t in zip(chunk, ids):
            if not t:  # the sampler would continue from nothing, and the trainer has no prompt token to score from
                raise ConfigError(f"{field}: prompt {p.prompt_id} (data_source {p.data_source!r}) renders to no tokens "
                                  "with the model's tokenizer; give it text, or check the tokenizer files")
            if len(t) <= max_tokens:
                kept.append(p)
            elif policy == "fail":
                raise ConfigError(
                    f"data.max_prompt_tokens: prompt {p.prompt_id} of {field} (data_source {p.data_source!r}) "
                    f"is {len(t)} tokens, over the limit of {max_tokens}; raise data.max_prompt_tokens or set "
                    "data.overlong_prompts=filter to drop such prompts"
                )
    dropped = len(prompts) - len(kept)
    if not kept:
        raise ConfigError(f"data.max_prompt_tokens: all {len(prompts)} prompts of {field} are over "
                          f"{max_tokens} tokens; raise data.max_prompt_tokens")
    return kept, dropped


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
