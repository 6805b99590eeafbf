import io
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.buffer.schema import ROLLOUT_SCHEMA, SCHEMA_VERSION_KEY, SchemaError, check_schema, content_hash, to_table
from pipeline.config import ConfigError
from pipeline.data import PromptRow, filter_overlong, load_prompts, write_rows
from pipeline.builtin_tasks import make_rows


def _row(i=0):
    import datetime as dt

    return {
        "sample_id": f"s{i}", "prompt_id": "p", "group_id": "g", "data_source": "builtin/sort",
        "prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5], "response_text": "ab",
        "behavior_logprobs": [-0.5, -1.25], "reward": 0.5, "token_rewards": None, "reward_extra": '{"acc": 0.0}',
        "finish_reason": "stop", "policy_version": 3, "sampler_id": "sampler-0",
        "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), "content_hash": content_hash([1, 2, 3], [4, 5]),
        "tier": "l1", "replay_count": 0, "priority": 1.0,
    }


def test_rollout_schema_round_trip_through_parquet():
    t = to_table([_row(0), _row(1)])
    buf = io.BytesIO()
    pq.write_table(t, buf, compression="zstd")
    back = pq.read_table(io.BytesIO(buf.getvalue()))
    check_schema(back.schema, "mem")
    assert back.schema.equals(ROLLOUT_SCHEMA, check_metadata=False)
    assert back.to_pylist() == t.to_pylist()


def test_newer_schema_version_is_refused_with_upgrade_hint():
    schema = ROLLOUT_SCHEMA.with_metadata({SCHEMA_VERSION_KEY: b"99"})
    with pytest.raises(SchemaError, match="upgrade"):
        check_schema(schema, "s3://b/shard.parquet")


def test_content_hash_depends_on_prompt_and_response():
    assert content_hash([1], [2]) == content_hash([1], [2])
    assert content_hash([1], [2]) != content_hash([1, 2], [])


@pytest.mark.parametrize("limit", [None, 1])  # all rows, or the first only (prepare's check)
@pytest.mark.parametrize("column, named", [("reward_model", "reward_model.ground_truth"), ("data_source", "data_source")])
def test_dataset_missing_column_is_named(tmp_path, limit, column, named):
    rows = make_rows("sort", 4, 0, "train")
    for r in rows:
        del r[column]
    url = str(tmp_path / "bad.parquet")
    write_rows(rows, url)
    with pytest.raises(ConfigError, match=f"lacks column '{named}'"):
        load_prompts(url, "data.train", limit=limit)


def test_checking_a_dataset_reads_its_first_rows_not_the_whole_file(tmp_path):
    """The first row group only: prepare checks datasets of millions of rows in the Airflow worker."""
    url = str(tmp_path / "many.parquet")
    pq.write_table(pa.Table.from_pylist(make_rows("sort", 3000, 0, "train")), url, row_group_size=500)
    seen = {}
    real = pq.ParquetFile.iter_batches

    def counting(self, *a, **k):
        for b in real(self, *a, **k):
            seen["rows"] = seen.get("rows", 0) + b.num_rows
            yield b

    pq.ParquetFile.iter_batches = counting
    try:
        assert [r.data_source for r in load_prompts(url, "data.train", limit=2)] == ["builtin/sort"] * 2
    finally:
        pq.ParquetFile.iter_batches = real
    assert seen["rows"] == 2


def test_a_held_out_set_the_rule_reward_cannot_score_is_refused_at_prepare(tmp_path):
    """Evaluations score with the rule reward, also in runs trained on a reward model: an unknown
    data_source of data.eval failed only in finalize, after all the training."""
    from pipeline.config import parse_config
    from pipeline.orchestration import validate_inputs

    url = str(tmp_path / "eval.parquet")
    write_rows(_verl_rows(["1", "2"]), url)
    for reward in ({"fn": "auto"}, {"kind": "model", "model": "/models/rm"}):
        cfg = parse_config({"model": {"path": "builtin:sort"}, "data": {"train": "builtin:sort", "eval": url},
                            "reward": reward})
        with pytest.raises(ConfigError, match="data.eval: reward.fn=auto: no built-in reward for data_source 'my/task'"):
            validate_inputs(cfg)


def test_training_prompts_the_reward_cannot_score_are_refused_at_prepare(tmp_path):
    """Before, the sampler refused them once the run had started (22 s into a million-row run)."""
    from pipeline.config import parse_config
    from pipeline.orchestration import validate_inputs

    url = str(tmp_path / "train.parquet")
    write_rows(_verl_rows(["1", "2"]), url)
    cfg = parse_config({"model": {"path": "builtin:sort"}, "data": {"train": url, "eval": "builtin:sort"}})
    with pytest.raises(ConfigError, match="^data.train: reward.fn=auto: no built-in reward for data_source 'my/task'"):
        validate_inputs(cfg)
    with pytest.raises(ConfigError, match="^reward.model: '/m' is not"):  # a reward model scores any source: past it
        validate_inputs(cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"kind": "model", "model": "/m"})}))


@pytest.mark.parametrize("remove, message", [
    (("model.safetensors",), "has no model.safetensors"),  # .bin weights only: the reshard path reads safetensors
    (("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"),
     "has no tokenizer files"),  # transformers builds an empty tokenizer, and the sampler failed on its first batch
])
def test_a_model_folder_without_safetensors_or_a_tokenizer_is_refused_at_prepare(tmp_path, remove, message):
    import shutil

    from pipeline.config import parse_config
    from pipeline.orchestration import resolve_sources, validate_inputs

    base = {"model": {"path": "builtin:sort"}, "data": {"train": "builtin:sort", "eval": "builtin:sort"}}
    folder = shutil.copytree(resolve_sources(parse_config(base))["model"], tmp_path / "model")
    for name in remove:
        (folder / name).unlink(missing_ok=True)
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=f"model.path: '{folder}' {message}"):
        validate_inputs(parse_config({**base, "model": {"path": str(folder)}}))


def test_a_reward_model_folder_is_checked_at_prepare_not_in_the_sampler(tmp_path):
    """reward.kind=model: a missing folder, or a model_label the reward model does not have, is
    refused before the run directory exists (both failed in the sampler, the first without naming
    reward.model)."""
    from pipeline.config import parse_config
    from pipeline.example import build_tiny_reward_model
    from pipeline.orchestration import resolve_sources, validate_inputs

    base = {"model": {"path": "builtin:digit"}, "data": {"train": "builtin:digit", "eval": "builtin:digit"}}
    missing = str(tmp_path / "no-such-rm")
    with pytest.raises(ConfigError, match=f"reward.model: '{missing}' is not a Hugging Face model folder"):
        validate_inputs(parse_config({**base, "reward": {"kind": "model", "model": missing}}))
    rm = build_tiny_reward_model(str(tmp_path / "rm"), resolve_sources(parse_config(base))["model"])
    validate_inputs(parse_config({**base, "reward": {"kind": "model", "model": rm}}))
    with pytest.raises(ConfigError, match="reward.model_label: 1 but the reward model has 1 label"):
        validate_inputs(parse_config({**base, "reward": {"kind": "model", "model": rm, "model_label": 1}}))


def test_answers_longer_than_the_models_positions_are_refused_at_prepare():
    """The tiny model has 256 positions: prompts of up to 128 tokens and 200-token answers would
    run past them (generated and trained on silently, or a crash with absolute positions)."""
    from pipeline.config import parse_config
    from pipeline.orchestration import validate_inputs

    base = {"model": {"path": "builtin:sort"}, "data": {"train": "builtin:sort", "eval": "builtin:sort"}}
    validate_inputs(parse_config({**base, "sampler": {"max_new_tokens": 128}}))
    with pytest.raises(ConfigError, match="sampler.max_new_tokens=200 and data.max_prompt_tokens=128: a prompt and "
                                          "its answer could take 328 tokens, past the model's 256 positions"):
        validate_inputs(parse_config({**base, "sampler": {"max_new_tokens": 200}}))
    with pytest.raises(ConfigError, match="eval.max_new_tokens=300"):
        validate_inputs(parse_config({**base, "eval": {"max_new_tokens": 300}}))
    validate_inputs(parse_config({**base, "sampler": {"max_new_tokens": 200}, "data": {
        "train": "builtin:sort", "eval": "builtin:sort", "max_prompt_tokens": 56}}))


def test_rope_scaling_and_a_reward_models_torch_weights_pass_prepare(tmp_path):
    """YaRN-style scaling gives a model more positions than max_position_embeddings; a reward model
    is loaded by transformers, which reads pytorch_model.bin as well as safetensors."""
    import json
    import shutil

    from safetensors.torch import load_file
    import torch

    from pipeline.config import parse_config
    from pipeline.example import build_tiny_reward_model
    from pipeline.orchestration import resolve_sources, validate_inputs

    base = {"model": {"path": "builtin:digit"}, "data": {"train": "builtin:digit", "eval": "builtin:digit"}}
    model = shutil.copytree(resolve_sources(parse_config(base))["model"], tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    (model / "config.json").write_text(json.dumps(cfg))
    validate_inputs(parse_config({**base, "model": {"path": str(model)}, "sampler": {"max_new_tokens": 600}}))
    rm = tmp_path / "rm"
    build_tiny_reward_model(str(rm), str(model))
    torch.save(load_file(rm / "model.safetensors"), rm / "pytorch_model.bin")
    (rm / "model.safetensors").unlink()
    validate_inputs(parse_config({**base, "reward": {"kind": "model", "model": str(rm)}}))


def test_a_prompt_that_renders_to_no_tokens_is_refused():
    with pytest.raises(ConfigError, match=r"data.train: prompt p1 \(data_source 's'\) renders to no tokens"):
        filter_overlong(_prompts("abc", ""), _CharTokenizer(), 4)


def test_dataset_rows_load_with_ids(tmp_path):
    url = str(tmp_path / "ok.parquet")
    write_rows(make_rows("digit", 5, 0, "train"), url)
    rows = load_prompts(url)
    assert len(rows) == 5 and len({r.prompt_id for r in rows}) == 5
    assert rows[0].messages[0]["role"] == "user"


def _verl_rows(ground_truths):
    return [{"data_source": "my/task", "prompt": [{"role": "user", "content": f"q{i}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": {"index": i}}
            for i, gt in enumerate(ground_truths)]


@pytest.mark.parametrize("truths", [
    [["7", "seven"], ["3"]],                                     # Arrow list column
    [{"answer": "7", "aliases": ["seven"]}, {"answer": "3", "aliases": []}],  # Arrow struct column
    [7, 3],
    ['{"inputs": [1], "outputs": [2]}', "plain"],                # JSON strings stay strings
])
def test_ground_truths_keep_their_type_through_parquet(tmp_path, truths):
    url = str(tmp_path / "verl.parquet")
    write_rows(_verl_rows(truths), url)
    rows = load_prompts(url)
    assert [r.ground_truth for r in rows] == truths
    assert rows[0].extra_info == {"index": 0}


class _CharTokenizer:
    """One token per character; no chat template."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [list(t) for t in texts]}


def _prompts(*contents):
    return [PromptRow(f"p{i}", "s", [{"role": "user", "content": c}], "", None) for i, c in enumerate(contents)]


def test_overlong_prompts_are_filtered_and_counted():
    kept, dropped = filter_overlong(_prompts("abc", "abcdefgh", "ab"), _CharTokenizer(), 4)
    assert [p.prompt_id for p in kept] == ["p0", "p2"] and dropped == 1


def test_overlong_prompt_fails_fast_naming_it_when_asked():
    with pytest.raises(ConfigError, match=r"prompt p1 of data.train \(data_source 's'\) is 8 tokens, over the "
                                          r"limit of 4"):
        filter_overlong(_prompts("abc", "abcdefgh"), _CharTokenizer(), 4, "fail")
    with pytest.raises(ConfigError, match="all 1 prompts of data.train are over 2 tokens"):
        filter_overlong(_prompts("abc"), _CharTokenizer(), 2)


@pytest.mark.parametrize("error, message", [
    (ImportError("Please install gcsfs to access Google Storage"), "needs a package that is not installed"),
    (RuntimeError("Unable to locate credentials"), "cannot read 'gs://b/t.parquet': RuntimeError: Unable to locate"),
])
def test_a_store_that_cannot_be_reached_is_a_config_error_naming_the_field(monkeypatch, error, message):
    import pipeline.data as data

    def fail(url):
        raise error

    monkeypatch.setattr(data, "url_to_fs", fail)
    with pytest.raises(ConfigError, match=f"data.eval: .*{message}"):
        load_prompts("gs://b/t.parquet", "data.eval")


@pytest.mark.parametrize("task", ["sort", "repeat"])
def test_the_built_in_held_out_prompts_are_unseen_in_training_and_distinct(task):
    from pipeline.example import split_rows

    rows = split_rows(task, 0)
    seen = {r["prompt"][0]["content"] for r in rows["train"]}
    held_out = [r["prompt"][0]["content"] for r in rows["test"]]
    assert len(held_out) == 256 and len(set(held_out)) == 256 and not seen & set(held_out)


def test_the_built_in_example_holds_those_splits():
    import os

    from pipeline.example import ensure_example, split_rows

    folder = ensure_example("sort")
    for split, rows in split_rows("sort", 0).items():
        got = load_prompts(os.path.join(folder, "data", f"{split}.parquet"))
        assert [p.messages for p in got] == [r["prompt"] for r in rows]


def test_a_dataset_is_kept_as_its_table_and_filtered_prompts_are_the_same_rows_as_a_list_gives(tmp_path):
    from pipeline.data import Prompts, read_prompts

    url = str(tmp_path / "d.parquet")
    rows = make_rows("sort", 300, 0, "train")
    for i in (5, 77, 201):
        rows[i]["prompt"] = [{"role": "user", "content": "x" * 40}]  # over the limit below
    write_rows(rows, url)
    prompts = read_prompts(url)
    assert isinstance(prompts, Prompts) and len(prompts) == 300
    as_list = load_prompts(url)
    assert list(prompts) == as_list and prompts.sources() == {"builtin/sort"}
    limit = max(len(p.messages[0]["content"]) for p in as_list if not p.messages[0]["content"].startswith("xxx"))
    kept, dropped = filter_overlong(prompts, _CharTokenizer(), limit)
    kept_list, dropped_list = filter_overlong(as_list, _CharTokenizer(), limit)
    assert isinstance(kept, Prompts) and dropped == dropped_list == 3
    assert [kept[i] for i in range(len(kept))] == kept_list  # same rows, same ids, same order


def test_a_long_length_check_says_how_far_it_got(monkeypatch):
    """A million long prompts took minutes before the sampler's first batch, with nothing said."""
    from pipeline import data

    now = [0.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    said = []
    progress = data.every(15.0, lambda done, n: said.append((done, n)))

    class Slow(_CharTokenizer):
        def __call__(self, texts, add_special_tokens=False):
            now[0] += 10.0  # each 1024 prompts take 10 s
            return super().__call__(texts, add_special_tokens)

    kept, _ = filter_overlong(_prompts(*["ab"] * 5000), Slow(), 4, progress=progress)
    assert len(kept) == 5000 and said == [(2048, 5000), (4096, 5000)]  # every 15 s at most, not at the end


def test_the_length_check_is_recorded_in_the_run_and_read_back_by_a_restart(tmp_path):
    """A restarted sampler (and every other replica) rendered and tokenized every prompt again."""
    from types import SimpleNamespace

    from pipeline.data import read_prompts, within_length

    url = str(tmp_path / "d.parquet")
    rows = make_rows("sort", 3000, 0, "train")
    rows[10]["prompt"] = [{"role": "user", "content": "x" * 400}]
    write_rows(rows, url)
    prompts, calls = read_prompts(url), []

    class Counting(_CharTokenizer):
        def __call__(self, texts, add_special_tokens=False):
            calls.append(len(texts))
            return super().__call__(texts, add_special_tokens)

    cfg = SimpleNamespace(max_prompt_tokens=300, overlong_prompts="filter")
    data_dir = str(tmp_path / "run" / "data")
    first = within_length(prompts, Counting(), cfg, data_dir)
    assert sum(calls) == 3000 and first[1] == 1 and len(first[0]) == 2999
    calls.clear()
    again = within_length(read_prompts(url), Counting(), cfg, data_dir)
    assert calls == [] and again[1] == 1 and list(again[0].rows) == list(first[0].rows)
    within_length(read_prompts(url), Counting(), SimpleNamespace(max_prompt_tokens=500, overlong_prompts="filter"),
                  data_dir)  # another limit: checked again, recorded beside
    assert sum(calls) == 3000
    write_rows(rows[:100], url)  # another table under the same name: its record does not apply
    calls.clear()
    assert within_length(read_prompts(url), Counting(), cfg, data_dir)[1] == 1 and sum(calls) == 100
    with pytest.raises(ConfigError, match="is 400 tokens, over the limit of 300"):  # the record holds for `filter` only
        within_length(read_prompts(url), Counting(), SimpleNamespace(max_prompt_tokens=300, overlong_prompts="fail"),
                      data_dir)


def test_prompts_by_id_makes_rows_only_for_the_ids_asked_for(tmp_path, monkeypatch):
    """What export and rescore look up: the prompts of the archived groups, not a row per prompt."""
    from pipeline import data

    url = str(tmp_path / "d.parquet")
    write_rows(make_rows("sort", 5000, 0, "train"), url)
    as_list = load_prompts(url)
    made, real = [], data._row
    monkeypatch.setattr(data, "_row", lambda r, raw: made.append(raw) or real(r, raw))
    wanted = {as_list[7].prompt_id, as_list[4321].prompt_id, "not-a-prompt"}
    assert data.read_prompts(url).by_id(wanted) == {p.prompt_id: p for p in (as_list[7], as_list[4321])}
    assert sorted(made) == [7, 4321]


@pytest.mark.parametrize("change, message", [
    ({"prompt": None}, "row 3 .* has no prompt \\(null\\)"),
    ({"prompt": []}, "row 3 .* has an empty prompt"),
    ({"reward_model": None}, "row 3 .* has no reward_model \\(null\\)"),
])
def test_rows_the_sampler_could_not_use_are_refused_when_the_dataset_is_staged(tmp_path, change, message):
    """Before, the run started and the sampler died on the draw that met the row (a TypeError)."""
    from pipeline.data import read_prompts, stage
    from pipeline.storage import url_to_fs

    rows = make_rows("sort", 8, 0, "train")
    rows[3].update(change)
    rows[6].update(change)
    url = str(tmp_path / "bad.parquet")
    write_rows(rows, url)
    for load in (lambda: stage(url, *url_to_fs(str(tmp_path / "staged.parquet")), "data.train"),
                 lambda: read_prompts(url), lambda: load_prompts(url, limit=5)):
        with pytest.raises(ConfigError, match=f"^data.train: dataset .* {message}(, as have 1 more rows)?; give every"):
            load()


def test_the_length_check_tokenizes_on_every_core_and_leaves_the_setting_as_it_was(tmp_path, monkeypatch):
    """The one pass over every training prompt ran on one core (TOKENIZERS_PARALLELISM=false, as the
    engines set it): 606 s for 250k long prompts, past the trainer's wait for its first rollouts."""
    from types import SimpleNamespace

    from pipeline.data import read_prompts, within_length

    url = str(tmp_path / "d.parquet")
    write_rows(make_rows("sort", 50, 0, "train"), url)
    seen = []

    class Recording(_CharTokenizer):
        def __call__(self, texts, add_special_tokens=False):
            seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
            if len(seen) == 2:
                raise RuntimeError("tokenizer failed")
            return super().__call__(texts, add_special_tokens)

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    cfg = SimpleNamespace(max_prompt_tokens=300, overlong_prompts="filter")
    within_length(read_prompts(url), Recording(), cfg, str(tmp_path / "a"))
    assert seen == ["true"] and os.environ["TOKENIZERS_PARALLELISM"] == "false"
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        within_length(read_prompts(url), Recording(), cfg, str(tmp_path / "b"))
    assert seen == ["true", "true"] and os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    within_length(read_prompts(url), _CharTokenizer(), cfg, str(tmp_path / "c"))
    assert "TOKENIZERS_PARALLELISM" not in os.environ


def test_a_folder_of_parquet_shards_is_one_dataset(tmp_path):
    """Hugging Face datasets and Spark write a dataset as shards; they were refused as not a file."""
    from pipeline.data import data_sources, read_prompts, stage
    from pipeline.storage import url_to_fs

    shards = tmp_path / "train"
    write_rows(make_rows("sort", 5, 1, "train"), str(shards / "part-00000.parquet"))
    rows = make_rows("repeat", 7, 2, "train")
    write_rows(rows, str(shards / "part-00001.parquet"))
    (shards / "_SUCCESS").write_bytes(b"")
    (shards / ".part-00002.parquet.tmp.parquet").write_bytes(b"partial")  # a writer's temporary file
    dst = tmp_path / "run" / "train.parquet"
    assert stage(str(shards), *url_to_fs(str(dst)), "data.train") == 12
    staged = read_prompts(str(dst))
    assert list(staged) == list(read_prompts(str(shards))) and len(staged) == 12
    assert [p.ground_truth for p in staged][5:] == [r["reward_model"]["ground_truth"] for r in rows]
    assert data_sources(str(shards), "data.train") == {"builtin/sort", "builtin/repeat"}
    assert len(load_prompts(str(shards), limit=8)) == 5  # the first rows: the first file's
    assert stage(str(shards), *url_to_fs(str(tmp_path / "eval.parquet")), "data.eval", limit=8) == 8

    rows[4]["prompt"] = []  # a bad row is numbered in the whole dataset
    write_rows(rows, str(shards / "part-00001.parquet"))
    with pytest.raises(ConfigError, match=r"^data.train: dataset .* row 9 \(data_source 'builtin/repeat'\) has an empty"):
        stage(str(shards), *url_to_fs(str(dst)), "data.train")
    write_rows([{k: v for k, v in r.items() if k != "reward_model"} for r in rows], str(shards / "part-00001.parquet"))
    with pytest.raises(ConfigError, match=r"lacks column 'reward_model.ground_truth'"):
        stage(str(shards), *url_to_fs(str(dst)), "data.train")
    write_rows([{**r, "extra_info": 3} for r in rows], str(shards / "part-00001.parquet"))
    with pytest.raises(ConfigError, match=r"\(file part-00001.parquet\) does not have the columns and types of the "
                                          r"dataset's other files"):
        stage(str(shards), *url_to_fs(str(dst)), "data.train")
    write_rows([{**r, "extra_info": None} for r in make_rows("repeat", 7, 2, "train")],  # a column of nulls
               str(shards / "part-00001.parquet"))
    assert stage(str(shards), *url_to_fs(str(dst)), "data.train") == 12
    assert [p.extra_info for p in read_prompts(str(dst))][4:6] == [make_rows("sort", 5, 1, "train")[4]["extra_info"], None]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no .parquet file"):
        stage(str(empty), *url_to_fs(str(dst)), "data.train")
