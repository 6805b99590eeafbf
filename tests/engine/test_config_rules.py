"""Settings and combinations that could never run as meant are refused when the config loads, in one
line naming them: before any run directory, process or model exists."""

import yaml
import pytest

from pipeline.config import ConfigError, load_config, parse_config
from pipeline.config_yaml import apply_overrides


def refused(overrides, match, path="configs/tiny-grpo.yaml"):
    with pytest.raises(ConfigError, match=match):
        load_config(path, overrides)


@pytest.mark.parametrize("setting", [
    "trainer.critic_lr=-1",        # a PPO critic climbing its own loss
    "buffer.l3_max_rows=-5",       # finalize deleted the whole archive
    "buffer.l3_retention_s=0",
    "eval.max_new_tokens=-5",      # a held-out score of 0.0
    "buffer.samples_per_insert=0",
    "buffer.max_fresh_backlog=-1",
    "sampler.poll_s=200",          # milliseconds meant: a run that seems to hang
])
def test_values_out_of_range_are_refused(setting):
    key = setting.split("=")[0]
    refused([setting], f"^{key}: Input should be")


def test_rate_limiter_bounds_that_no_run_could_meet_are_refused():
    refused(["buffer.max_fresh_backlog=8"], "buffer.max_fresh_backlog=8: .* take 16 groups.* at least 16")
    load_config("configs/tiny-grpo.yaml", ["buffer.max_fresh_backlog=16"])
    refused(["buffer.samples_per_insert=2"], r"samples_per_insert=2.0: a group is trained on at most 1 time.*replay "
                                             r"being off")
    load_config("configs/tiny-grpo.yaml", ["buffer.samples_per_insert=2", "trainer.replay_epochs=2"])
    refused(["buffer.samples_per_insert=4", "trainer.replay_epochs=2"], "at most 3 time")
    refused(["buffer.samples_per_insert=1", "buffer.rate_error_groups=8"], "buffer.rate_error_groups=8 with")


def test_replay_settings_that_leave_nothing_to_replay_are_refused_at_load_not_in_the_trainer():
    refused(["trainer.replay_epochs=1", "buffer.max_replays_per_group=0"],
            "^trainer.replay_epochs=1 but buffer.max_replays_per_group=0")
    refused(["buffer.l2_min_reward_mean=0.9", "buffer.l2_max_reward_mean=0.1"],
            "^buffer.l2_min_reward_mean=0.9 is above buffer.l2_max_reward_mean=0.1")


@pytest.mark.parametrize("endpoint, ok", [("garbage!", False), ("host:70000", False), ("h:0", False), ("'h:'", False),
                                          ("node-0.svc:29400", True), ("'[fd00::1]:29400'", True),
                                          ("node-0", True), ("''", True)])  # torchrun's port 29400; automatic
def test_the_rendezvous_is_host_and_port(endpoint, ok):
    if ok:
        load_config("configs/tiny-grpo.yaml", [f"trainer.rendezvous={endpoint}"])
    else:
        refused([f"trainer.rendezvous={endpoint}"], "^trainer.rendezvous: .* is not host:port")


def test_vllm_options_the_pipeline_sets_itself_are_refused_at_load():
    refused(["sampler.vllm={dtype: half}"], "^sampler.vllm: 'dtype' is set by the pipeline")
    refused(["sampler.vllm={enforce_eager: no}"], "^sampler.vllm: enforce_eager: 'no' is a string; write true or false")


def test_critic_settings_are_refused_with_an_algorithm_that_has_no_critic():
    refused(["trainer.vf_coef=2", "trainer.critic_lr=1e-3"],
            "^trainer.critic_lr, trainer.vf_coef: settings of the critic, which algorithm grpo does not train")
    refused(["trainer.algorithm=rloo"], "trainer.critic_lr, trainer.gae_lambda: .* algorithm rloo", "configs/tiny-ppo.yaml")
    for path in ("configs/tiny-ppo.yaml", "configs/tiny-grpo.yaml"):  # a frozen config holds every default
        cfg = load_config(path)
        assert parse_config(yaml.safe_load(cfg.to_yaml())) == cfg


def test_a_number_given_for_a_text_setting_says_to_quote_it():
    refused(["run_id=007"], "^run_id: a text setting, which YAML read as the number 7; quote the value as written")
    refused(["model.path=1e3"], "^model.path: a text setting, which YAML read as the number 1000.0; quote")
    assert load_config("configs/tiny-grpo.yaml", ["run_id='007'"]).run_id == "007"


def test_std_normalize_off_is_refused_with_an_algorithm_that_would_ignore_it():
    load_config("configs/tiny-grpo.yaml", ["trainer.std_normalize=false"])  # grpo: Dr. GRPO's advantages
    for algo, path in (("dr_grpo", "configs/tiny-grpo.yaml"), ("rloo", "configs/tiny-grpo.yaml"),
                       ("ppo", "configs/tiny-ppo.yaml")):
        refused([f"trainer.algorithm={algo}", "trainer.std_normalize=false"],
                f"^trainer.std_normalize=false changes only grpo's advantages, and algorithm {algo} would ignore it",
                path)


def test_a_run_directory_whose_settings_a_newer_rule_refuses_still_loads(tmp_path):
    """A run whose config.yaml has a critic setting under grpo (ignored, as before the rule) resumes,
    evaluates and exports; a new run with it is refused."""
    from pipeline.rundir import RunDir

    run = RunDir(f"file://{tmp_path}/old")
    run.create(load_config("configs/tiny-grpo.yaml"))
    frozen = yaml.safe_load(run.fs.cat_file(run.path("config.yaml")))
    frozen["trainer"]["vf_coef"] = 0.3
    run.fs.pipe_file(run.path("config.yaml"), yaml.safe_dump(frozen).encode())
    assert run.config().trainer.vf_coef == 0.3
    with pytest.raises(ConfigError, match="settings of the critic"):
        parse_config(frozen)
    frozen["sampler"]["poll_s"] = 200  # a value a run could not use: named, with where to fix it
    run.fs.pipe_file(run.path("config.yaml"), yaml.safe_dump(frozen).encode())
    with pytest.raises(ConfigError, match=r"its config.yaml does not load \(sampler.poll_s: .*\); fix that setting in"):
        run.create(load_config("configs/tiny-grpo.yaml"))


@pytest.mark.parametrize("text", ["1e3", "0o17", "yes", "2026-11-08", "1:30", "010", "~", "1_000"])
def test_a_snapshot_reads_back_the_same_as_yaml_1_1_and_1_2(text):
    from pipeline.config_yaml import load_yaml_text

    cfg = parse_config({"run_id": text} if text not in ("~", "1:30") else {"model": {"path": text}})
    dumped = cfg.to_yaml()
    assert parse_config(yaml.safe_load(dumped)) == cfg == parse_config(load_yaml_text(dumped))


def test_override_values_are_read_as_yaml_1_2():
    cfg = load_config("configs/tiny-grpo.yaml", ["trainer.steps=010", 'sampler.vllm={"gpu_memory_utilization": 5e-1}',
                                                 "run_id=2026-11-08"])
    assert cfg.trainer.steps == 10  # YAML 1.1: octal 8
    assert cfg.sampler.vllm == {"gpu_memory_utilization": 0.5}  # YAML 1.1: the string '5e-1'
    assert cfg.run_id == "2026-11-08"  # YAML 1.1: a date
    refused(["trainer.steps=1:30"], "got '1:30'")  # YAML 1.1: 90 (base 60)


def test_a_mapping_override_merges_into_its_section():
    data = apply_overrides({"trainer": {"lr": 5e-4, "micro_batch_tokens": 1024}}, ["trainer.steps=20", "trainer={}"])
    assert data == {"trainer": {"lr": 5e-4, "micro_batch_tokens": 1024, "steps": 20}}
    data = apply_overrides(data, ["trainer={steps: 5, kl_coef: 0.01}"])
    assert data == {"trainer": {"lr": 5e-4, "micro_batch_tokens": 1024, "steps": 5, "kl_coef": 0.01}}
    data = apply_overrides({"sampler": {"vllm": {"max_model_len": 4096}}}, ["sampler.vllm={}"])
    assert data == {"sampler": {"vllm": {}}}  # a free-form mapping is replaced: this clears it


def test_a_form_override_of_an_empty_section_keeps_the_form_and_the_file():
    from plugins.dag_params import build_config, run_params

    params = {k: p.value for k, p in run_params().items()}
    params.update(config_file="tiny-grpo.yaml", steps=20, overrides={"trainer": {}})
    cfg = build_config(params, {}, "exp-1")
    assert (cfg.trainer.steps, cfg.trainer.lr, cfg.trainer.micro_batch_tokens) == (20, 5e-4, 1024)


def test_malformed_overrides_and_an_old_name_beside_the_new_say_what_is_wrong():
    with pytest.raises(ConfigError, match="override '=3': no key before ="):
        parse_config({}, ["=3"])
    with pytest.raises(ConfigError, match="override 'trainer..steps=3': an empty key part"):
        parse_config({}, ["trainer..steps=3"])
    with pytest.raises(ConfigError, match="^config key 'buffer.num_epochs_per_sample' is the old name of "
                                          "'buffer.max_replays_per_group'; give only one of them"):
        parse_config({"buffer": {"max_replays_per_group": 2, "num_epochs_per_sample": 3}})
    assert parse_config({"buffer": {"num_epochs_per_sample": 3}}).buffer.max_replays_per_group == 3


def test_a_run_directory_with_other_settings_names_them(tmp_path):
    from pipeline.rundir import RunDir

    run = RunDir(f"file://{tmp_path}/r1")
    assert run.create(load_config("configs/tiny-grpo.yaml"))
    assert not run.create(load_config("configs/tiny-grpo.yaml", ["trainer.threads=2"]))  # a resume at another scale
    with pytest.raises(ConfigError, match=r"already holds a different config: trainer.lr \(0.0005 there, 0.001 here\), "
                                          r"trainer.kl_coef \(0.0 there, 0.1 here\); resume it with its own settings"):
        run.create(load_config("configs/tiny-grpo.yaml", ["trainer.lr=1e-3", "trainer.kl_coef=0.1"]))
