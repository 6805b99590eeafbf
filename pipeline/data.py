"""Prompt datasets in verl's column layout, validated before anything expensive happens.

Required columns: `data_source`, `prompt` (list of chat messages or a string),
`reward_model.ground_truth`. Optional: `ability`, `extra_info` (a struct/dict).

`ground_truth` and `extra_info` keep the type the Parquet column gives them: a string, a number,
a list (Arrow list column) or a dict (Arrow struct column), and reach the reward function as such.
A ground truth stored as a JSON string stays a string: the reward function decodes it, as in verl.

A dataset is one Parquet file or a folder of them: every `*.parquet` directly in it, in name order
(the shards Hugging Face datasets and Spark write, a `ds=<date>` partition), all with the same
columns (a column of nulls in one file takes the type the others give it). Prepare stages it into
the run as one file.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from .config import ConfigError
from .locations import reaching
from .storage import parquet_from_bytes, put_atomic, read_bytes, staged_file, url_to_fs

REQUIRED = ("data_source", "prompt", "reward_model.ground_truth")


@dataclass(frozen=True)
class PromptRow:
    prompt_id: str
    data_source: str
    messages: list | str
    ground_truth: Any  # as the dataset holds it: str, number, list or dict
    extra_info: dict | None


def data_files(fs, folder: str) -> list[str]:
    """The Parquet files directly in `folder`, in name order; names starting with '.' or '_' are not data."""
    return sorted(p for p in fs.glob(f"{folder}/*.parquet") if not p.rsplit("/", 1)[-1].startswith((".", "_")))


def _dataset_files(url: str, field: str) -> tuple[Any, list[str]]:
    """The Parquet files of the dataset at `url` (see the module docstring)."""
    with reaching(field, url):
        fs, path = url_to_fs(url)
        path = path.rstrip("/")
        if fs.isdir(path):
            files = data_files(fs, path)
            if not files:
                raise ConfigError(f"{field}: folder {url!r} holds no .parquet file; give a Parquet file, or a folder "
                                  "of them, in verl's column layout")
            return fs, files
        if not fs.exists(path):
            raise ConfigError(f"{field}: dataset {url!r} not found; give a Parquet file, or a folder of them, in "
                              "verl's column layout")
    return fs, [path]


def _where(url: str, path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return repr(url) if url.rstrip("/").rsplit("/", 1)[-1] == name else f"{url!r} (file {name})"


def _unified(schemas: list[tuple[str, pa.Schema]], url: str, field: str) -> pa.Schema:
    """One schema for the files' (a column of nulls in one file takes another's type)."""
    schema = schemas[0][1]
    for path, other in schemas[1:]:
        try:
            schema = pa.unify_schemas([schema, other], promote_options="default")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise ConfigError(f"{field}: {_where(url, path)} does not have the columns and types of the dataset's other "
                              f"files ({e}); give every file the same columns") from None
    return schema


def _conform(table: pa.Table, schema: pa.Schema, url: str, path: str, field: str) -> pa.Table:
    """`table` with the dataset's columns and types (`_unified`)."""
    if table.schema.equals(schema, check_metadata=False):
        return table
    try:
        return table.select(schema.names).cast(schema)
    except (KeyError, ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ConfigError(f"{field}: {_where(url, path)} does not have the columns and types of the dataset's other "
                          f"files ({e}); give every file the same columns") from None


def _read_table(url: str, field: str) -> pa.Table:
    """The whole dataset, each file read in one request."""
    fs, files = _dataset_files(url, field)
    tables: list[tuple[str, pa.Table]] = []
    for path in files:
        with reaching(field, url):
            data = fs.cat_file(path)
        try:
            tables.append((path, parquet_from_bytes(data)))
        except (pa.ArrowInvalid, OSError) as e:
            raise ConfigError(f"{field}: {_where(url, path)} is not a readable Parquet file ({e})") from None
        validate_schema(tables[-1][1].schema, None, url, field)
    schema = _unified([(path, t.schema) for path, t in tables], url, field)
    return pa.concat_tables([_conform(t, schema, url, path, field) for path, t in tables])


@contextmanager
def _parquet_file(fs, path: str, url: str, field: str) -> Iterator[pq.ParquetFile]:
    """One file of the dataset opened for reading parts of it (its schema, a column, some rows)."""
    with reaching(field, url):
        f = fs.open(path, "rb")
    with f:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowInvalid, OSError) as e:
            raise ConfigError(f"{field}: {_where(url, path)} is not a readable Parquet file ({e})") from None
        validate_schema(pf.schema_arrow, None, url, field)
        yield pf


def _batches(url: str, field: str, rows: int = 8192) -> Iterator[pa.Table]:
    """The dataset's rows, up to `rows` at a time, file after file, with the dataset's types."""
    fs, files = _dataset_files(url, field)
    schemas = []
    for path in files if len(files) > 1 else ():
        with _parquet_file(fs, path, url, field) as pf:
            schemas.append((path, pf.schema_arrow))
    schema = _unified(schemas, url, field) if schemas else None
    for path in files:
        with _parquet_file(fs, path, url, field) as pf:
            for batch in pf.iter_batches(batch_size=rows, use_threads=False):
                table = pa.Table.from_batches([batch])
                yield table if schema is None else _conform(table, schema, url, path, field)


def validate_columns(table: pa.Table, url: str, field: str) -> None:
    validate_schema(table.schema, table.num_rows, url, field)
    _validate_rows(table, url, field)


def _validate_rows(table: pa.Table, url: str, field: str, offset: int = 0) -> None:
    """Rows the sampler could not use, named by the first of them (whole columns at once: a
    million rows in milliseconds). Found here, before the run starts, not at the draw that meets one.
    `offset`: the dataset's row number of the table's first row."""
    import pyarrow.compute as pc

    prompt, rm = table.column("prompt"), table.column("reward_model")
    empty = pc.equal(pc.list_value_length(prompt), 0) if pa.types.is_list(prompt.type) else \
        pc.equal(pc.utf8_length(prompt), 0) if pa.types.is_string(prompt.type) else None
    for what, bad in (("no prompt (null)", pc.is_null(prompt)), ("an empty prompt", empty),
                      ("no reward_model (null)", pc.is_null(rm))):
        if bad is None or not pc.any(bad).as_py():
            continue
        i = pc.index(bad, True).as_py()
        n = pc.sum(bad).as_py()
        raise ConfigError(f"{field}: dataset {url!r} row {offset + i} (data_source {table.column('data_source')[i].as_py()!r}) "
                          f"has {what}" + (f", as have {n - 1} more rows" if n > 1 else "")
                          + "; give every row a prompt (chat messages or text) and reward_model.ground_truth")


def validate_schema(schema: pa.Schema, num_rows: int | None, url: str, field: str) -> None:
    """The columns verl's layout needs, and rows (`num_rows` None: not counted here)."""
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
    fs, files = _dataset_files(url, field)
    found: set[str] = set()
    for path in files:
        with _parquet_file(fs, path, url, field) as pf:
            found |= {str(s) for s in pf.read(columns=["data_source"], use_threads=False).column(0).unique().to_pylist()}
    return found


def prompt_id_of(row: dict, index: int) -> str:
    body = json.dumps([row["data_source"], row["prompt"], index], sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


class Prompts:
    """A dataset's prompts as a sequence of `PromptRow`, made when a row is asked for: the Arrow
    table and which of its rows count (`select`). A million chat prompts take the table's ~160 MB
    here; as rows made up front they took 2 GB and 13 s before the first batch."""

    def __init__(self, table: pa.Table, rows=None):
        import numpy as np

        self.table = table
        self.rows = np.arange(table.num_rows, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        raw = int(self.rows[i])
        return _row(self.table.slice(raw, 1).to_pylist()[0], raw)

    def __iter__(self) -> Iterator[PromptRow]:
        return (_row(r, raw) for raw, r in self._dicts())

    def _dicts(self) -> Iterator[tuple[int, dict]]:
        """(table row, the row as `to_pylist` gives it) of this sequence, 4096 rows a conversion."""
        for start in range(0, len(self), 4096):
            rows = self.rows[start:start + 4096]
            yield from zip(rows.tolist(), self.table.take(rows).to_pylist())

    def messages(self, start: int, stop: int) -> list:
        """The `prompt` values of rows start..stop-1 of this sequence."""
        return self.table.column("prompt").take(self.rows[start:stop]).to_pylist()

    def select(self, positions) -> "Prompts":
        """The rows at `positions` of this sequence, in that order."""
        return Prompts(self.table, self.rows[positions])

    def by_id(self, wanted: set[str] | None = None) -> dict[str, PromptRow]:
        """{prompt id: row} of the rows whose id is in `wanted` (None: all), the table read 4096
        rows at a time."""
        out: dict[str, PromptRow] = {}
        for raw, r in self._dicts():
            if wanted is None or prompt_id_of(r, raw) in wanted:
                row = _row(r, raw)
                out[row.prompt_id] = row
        return out

    def sources(self) -> set[str]:
        return {str(s) for s in self.table.column("data_source").take(self.rows).unique().to_pylist()}


def _row(r: dict, raw: int) -> PromptRow:
    """Table row `raw` (as `to_pylist` gives it) as a PromptRow."""
    return PromptRow(prompt_id=prompt_id_of(r, raw), data_source=str(r["data_source"]), messages=r["prompt"],
                     ground_truth=r["reward_model"]["ground_truth"], extra_info=r.get("extra_info"))


def read_prompts(url: str, field: str = "data.train") -> Prompts:
    """The whole dataset's prompts, validated (see `Prompts`)."""
    table = _read_table(url, field)
    validate_columns(table, url, field)
    return Prompts(table)


def load_prompts(url: str, field: str = "data.train", limit: int | None = None) -> list[PromptRow]:
    """The dataset's prompts as rows; with `limit`, its first rows only, read without the rest
    (checking a dataset of millions of rows reads its schema and one batch, not the whole file)."""
    if limit is None:
        return list(read_prompts(url, field))
    batches = _batches(url, field, rows=max(limit, 1))
    table = next(batches, None)
    batches.close()
    if table is None:
        raise ConfigError(f"{field}: dataset {url!r} has no rows")
    table = table.slice(0, limit)
    validate_columns(table, url, field)
    return list(Prompts(table))


def filter_overlong(prompts, tokenizer, max_tokens: int, policy: str = "filter",
                    field: str = "data.train", progress=None):
    """Prompts (a list of `PromptRow` or `Prompts`, returned as such) whose rendered text is at
    most `max_tokens` tokens, and how many were longer; rendered 1024 at a time, `progress(done,
    total)` called after each 1024.

    policy `filter` drops the longer ones (verl's `filter_overlong_prompts`); `fail` raises a
    ConfigError naming the first one."""
    from .models import prompt_token_ids

    kept: list[int] = []
    for start in range(0, len(prompts), 1024):
        stop = min(start + 1024, len(prompts))
        texts = prompts.messages(start, stop) if isinstance(prompts, Prompts) else \
            [p.messages for p in prompts[start:stop]]
        for j, t in enumerate(prompt_token_ids(tokenizer, texts), start):
            if not t:  # the sampler would continue from nothing, and the trainer has no prompt token to score from
                p = prompts[j]
                raise ConfigError(f"{field}: prompt {p.prompt_id} (data_source {p.data_source!r}) renders to no tokens "
                                  "with the model's tokenizer; give it text, or check the tokenizer files")
            if len(t) <= max_tokens:
                kept.append(j)
            elif policy == "fail":
                p = prompts[j]
                raise ConfigError(
                    f"data.max_prompt_tokens: prompt {p.prompt_id} of {field} (data_source {p.data_source!r}) "
                    f"is {len(t)} tokens, over the limit of {max_tokens}; raise data.max_prompt_tokens or set "
                    "data.overlong_prompts=filter to drop such prompts"
                )
        if progress is not None:
            progress(stop, len(prompts))
    dropped = len(prompts) - len(kept)
    if not kept:
        raise ConfigError(f"data.max_prompt_tokens: all {len(prompts)} prompts of {field} are over "
                          f"{max_tokens} tokens; raise data.max_prompt_tokens")
    return (prompts.select(kept) if isinstance(prompts, Prompts) else [prompts[j] for j in kept]), dropped


def within_length(prompts: Prompts, tokenizer, data_cfg, data_url: str, progress=None) -> tuple[Prompts, int]:
    """`filter_overlong` of the run's training prompts under `data_cfg` (max_prompt_tokens,
    overlong_prompts), its result recorded in the run's data folder `data_url` (the rows kept, a
    Parquet column, named by both settings): a sampler that restarts, and every other replica,
    reads it instead of rendering and tokenizing every prompt again (105 s for a million short
    prompts). A record of another table (its row count) is not used. The check itself tokenizes on
    every core (`models.tokenizing_on_every_core`)."""
    max_tokens, policy = data_cfg.max_prompt_tokens, data_cfg.overlong_prompts
    fs, path = url_to_fs(f"{data_url.rstrip('/')}/train.within-{max_tokens}-{policy}.parquet")
    try:
        table = parquet_from_bytes(read_bytes(fs, path))
        meta = json.loads(table.schema.metadata[b"rlhf"])
        if meta["rows"] == prompts.table.num_rows:
            return Prompts(prompts.table, table.column("row").to_numpy()), int(meta["dropped"])
    except (FileNotFoundError, KeyError, ValueError, TypeError, pa.ArrowInvalid, OSError):
        pass
    from .models import tokenizing_on_every_core

    with tokenizing_on_every_core():  # once per run, before the first batch
        kept, dropped = filter_overlong(prompts, tokenizer, max_tokens, policy, progress=progress)
    record = pa.table({"row": pa.array(kept.rows, pa.int64())}).replace_schema_metadata(
        {"rlhf": json.dumps({"rows": prompts.table.num_rows, "dropped": dropped, "max_prompt_tokens": max_tokens})})
    _put_parquet(record, fs, path)
    return kept, dropped


def held_out_within_length(url: str, tokenizer, data_cfg) -> tuple[list[PromptRow], int]:
    """The held-out prompts at `url` within data.max_prompt_tokens, the longer ones dropped (and
    counted) or refused as data.overlong_prompts says, as for training: a longer prompt and its
    answer may not fit the model's positions (`check_context` counts on the limit). Unchecked, a
    256-position model scored 405-token prompts without a word, and vLLM would refuse them when
    finalize evaluates, after training."""
    return filter_overlong(load_prompts(url, "data.eval"), tokenizer, data_cfg.max_prompt_tokens,
                           data_cfg.overlong_prompts, field="data.eval")


def every(seconds: float, say):
    """A `progress(done, total)` that calls `say(done, total)` at most once per `seconds`, from
    `seconds` after it is made (a short pass says nothing), and never for the end."""
    said = [time.monotonic()]

    def progress(done: int, total: int) -> None:
        if done < total and time.monotonic() - said[0] >= seconds:
            say(done, total)
            said[0] = time.monotonic()
    return progress


def stage(src_url: str, dst_fs, dst_path: str, field: str, limit: int | None = None) -> int:
    """Validate the dataset at `src_url` (its first `limit` rows) and publish them into the run
    directory as one zstd Parquet file, through a local file: read 8192 rows at a time, written in
    row groups of up to 65536 rows or 64 MB. Read whole, 2M short prompts took 640 MB of memory and
    250k long ones (a 509 MB file) 1.5 GB. Returns rows."""
    writer, rows, group = None, 0, []
    batches = _batches(src_url, field)
    with staged_file(dst_fs, dst_path) as local:
        try:
            for table in batches:
                table = table.slice(0, None if limit is None else limit - rows)
                _validate_rows(table, src_url, field, rows)
                writer = writer or pq.ParquetWriter(local, table.schema, compression="zstd")
                group.append(table)
                rows += table.num_rows
                if sum(t.num_rows for t in group) >= 65536 or sum(t.nbytes for t in group) >= 64 << 20:
                    writer.write_table(pa.concat_tables(group))
                    group = []
                if limit is not None and rows >= limit:
                    break
            if group:
                writer.write_table(pa.concat_tables(group))
        finally:
            batches.close()
            if writer is not None:
                writer.close()
        if not rows:
            raise ConfigError(f"{field}: dataset {src_url!r} has no rows")
    return rows


def write_rows(rows: list[dict], url: str) -> None:
    _put_parquet(pa.Table.from_pylist(rows), *url_to_fs(url))


def _put_parquet(table: pa.Table, fs, path: str) -> None:
    """`table` as a zstd Parquet file at `path`, put atomically."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    put_atomic(fs, path, buf.getvalue())
