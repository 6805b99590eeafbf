import pytest

from pipeline.config import ConfigError, load_config, parse_config, validate_run_id


def test_defaults_are_valid():
    cfg = parse_config({})
    assert cfg.trainer.algorithm == "grpo" and cfg.sampler.group_size >= 2


def test_unknown_key_names_the_key_and_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        parse_config({"trainer": {"stepz": 3}})
    msg = str(e.value)
    assert "trainer.stepz" in msg and "steps" in msg and "\n" not in msg


def test_wrong_type_names_field_and_value():
    with pytest.raises(ConfigError) as e:
        parse_config({"trainer": {"lr": "fast"}})
    assert "trainer.lr" in str(e.value) and "'fast'" in str(e.value)


def test_overrides_are_parsed_as_yaml_scalars():
    cfg = parse_config({}, ["trainer.steps=7", "sampler.temperature=0.5", "reward.fn=digit"])
    assert cfg.trainer.steps == 7 and cfg.sampler.temperature == 0.5 and cfg.reward.fn == "digit"


def test_override_without_equals_is_rejected():
    with pytest.raises(ConfigError, match="key=value"):
        parse_config({}, ["trainer.steps"])


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", ".hidden", "x" * 200, "a..b", "run id"])
def test_invalid_run_ids_are_rejected(bad):
    with pytest.raises(ConfigError, match="run_id"):
        validate_run_id(bad)


def test_run_id_in_config_is_validated():
    with pytest.raises(ConfigError, match="run_id"):
        parse_config({"run_id": "../../x"})


def test_indivisible_batch_sizes_are_rejected():
    with pytest.raises(ConfigError, match="groups_per_step"):
        parse_config({"trainer": {"groups_per_step": 6}, "sampler": {"prompts_per_batch": 4}})


def test_publishing_less_often_than_the_staleness_bound_allows_is_rejected():
    # versions every 4 steps, batches at most 2 steps stale: from step 4 on no batch could be trained
    with pytest.raises(ConfigError, match="sync_every=4 and sampler.max_staleness=2"):
        parse_config({"trainer": {"sync_every": 4}, "sampler": {"max_staleness": 2}})
    parse_config({"trainer": {"sync_every": 3}, "sampler": {"max_staleness": 2}})


def test_shipped_configs_load():
    for name in ("configs/tiny-grpo.yaml", "configs/tiny-test.yaml"):
        load_config(name)
