"""Each device-heavy process of a run gets its own accelerators (checked with fake device ids)."""

import json
import sys

import pytest

from pipeline.config import DevicesConfig, parse_config
from pipeline.devices import MEMORY_FRACTION_ENV, role_environment, split_devices, trainer_ranks


@pytest.mark.parametrize("n", range(2, 9))
def test_split_is_disjoint_covers_every_device_and_gives_sampling_about_its_share(n):
    ids = [str(i) for i in range(n)]
    split = split_devices(ids, 0.3)
    assert not set(split["sampler"]) & set(split["trainer"])
    assert split["sampler"] + split["trainer"] == ids
    assert split["sampler"] and split["trainer"]
    assert abs(len(split["sampler"]) - 0.3 * n) < 1


def test_one_device_is_shared_and_the_sampler_is_told_its_memory_share():
    cfg = DevicesConfig(sampler_share=0.25)
    env = {"CUDA_VISIBLE_DEVICES": "3"}
    assert role_environment("sampler", cfg, env) == {"CUDA_VISIBLE_DEVICES": "3", MEMORY_FRACTION_ENV: "0.250"}
    assert role_environment("trainer", cfg, env) == {"CUDA_VISIBLE_DEVICES": "3"}


def test_dedicated_devices_are_not_split_nor_shared_by_role():
    """A worker per GPU, or a pod with its own GPU limit: the task takes what it sees."""
    cfg = DevicesConfig(sampler_share=0.25)
    one, two = {"CUDA_VISIBLE_DEVICES": "3", "RLHF_DEDICATED_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "4,5", "RLHF_DEDICATED_DEVICES": "1"}
    assert role_environment("sampler", cfg, one) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert role_environment("sampler", cfg, two) == role_environment("trainer", cfg, two) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert trainer_ranks(cfg, 1, two) == 2
    assert trainer_ranks(cfg, 1, {**two, "RLHF_DEDICATED_DEVICES": "0"}) == 1  # shared: the trainer's part of the split


def test_replicas_that_share_a_sampling_device_split_its_memory():
    """More replicas than sampling accelerators take them in turn; each is told its part of vLLM's
    default share (two engines at 0.9 each on one GPU: the second fails for memory)."""
    cfg = DevicesConfig(sampler_share=0.5)
    four = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # sampling: 0,1; training: 2,3

    def env_of(replica, replicas, env=four):
        return role_environment("sampler", cfg, env, replica=replica, replicas=replicas)

    assert [env_of(i, 3) for i in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "0", MEMORY_FRACTION_ENV: "0.450"},
        {"CUDA_VISIBLE_DEVICES": "1", MEMORY_FRACTION_ENV: "0.900"},
        {"CUDA_VISIBLE_DEVICES": "0", MEMORY_FRACTION_ENV: "0.450"}]
    assert [env_of(i, 2) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    two = {"CUDA_VISIBLE_DEVICES": "0,1"}  # sampling: 0; training: 1
    assert {env_of(i, 2, two)[MEMORY_FRACTION_ENV] for i in range(2)} == {"0.450"}
    assert env_of(0, 1, two) == {"CUDA_VISIBLE_DEVICES": "0"}


def test_more_trainer_ranks_than_trainer_devices_is_a_config_error(monkeypatch):
    from pipeline import devices
    from pipeline.config import ConfigError

    cfg = DevicesConfig(sampler_share=0.5)
    four, one = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, {"CUDA_VISIBLE_DEVICES": "0"}
    monkeypatch.setattr(devices, "_DRIVER_PATHS", ("/",))  # a machine with a GPU driver
    assert trainer_ranks(cfg, 2, four) == 2 and trainer_ranks(cfg, 1, four) == 2
    with pytest.raises(ConfigError, match=r"nproc_per_node=3: the trainer has 2 accelerator\(s\).*ids 2,3.*at most 2"):
        trainer_ranks(cfg, 3, four)
    with pytest.raises(ConfigError, match="at most 1"):  # one GPU shared with the sampler
        trainer_ranks(cfg, 2, one)
    assert trainer_ranks(cfg, 4, {**four, "RLHF_DEDICATED_DEVICES": "1"}) == 4
    assert trainer_ranks(DevicesConfig(count=0), 8, {}) == 8  # CPU ranks: as many as asked
    # CUDA_VISIBLE_DEVICES set by a scheduler on a machine without a GPU driver: CPU ranks, as before
    monkeypatch.setattr(devices, "_DRIVER_PATHS", ("/no/such/driver",))
    assert trainer_ranks(cfg, 4, one) == 4


def test_a_cpu_only_machine_sets_nothing():
    assert role_environment("trainer", DevicesConfig(count=0), {}) == {}
    assert trainer_ranks(DevicesConfig(count=0), 1, {}) == 1


def test_local_runner_starts_sampler_and_trainer_on_disjoint_devices(monkeypatch, tmp_path):
    from pipeline import local_runner as runner
    from pipeline.rundir import RunDir

    started = {}

    class FakePopen:
        def __init__(self, argv, env, **kw):
            started[argv[argv.index("pipeline") + 1]] = (argv, env)

    monkeypatch.setattr(runner.subprocess, "Popen", FakePopen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    cfg = parse_config({})
    run = RunDir(f"file://{tmp_path}/r1")
    runner._child("sampler", run, cfg, 1)
    runner._child("trainer", run, cfg, 1, trainer_ranks(cfg.devices, cfg.trainer.nproc_per_node))
    sampler = started["sampler"][1]["CUDA_VISIBLE_DEVICES"].split(",")
    trainer = started["trainer"][1]["CUDA_VISIBLE_DEVICES"].split(",")
    assert sampler == ["0", "1", "2"] and trainer == ["3", "4", "5", "6", "7"]
    assert "--nproc-per-node=5" in started["trainer"][0]  # one rank per trainer device


def test_airflow_operators_give_each_role_its_devices(monkeypatch, tmp_path):
    from pipeline.rundir import RunDir
    from plugins.operators import RlhfProcessOperator

    run = RunDir(f"file://{tmp_path}/r2")
    run.create(parse_config({"devices": {"sampler_share": 0.5}}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    seen = {}
    for role in ("sampler", "trainer", "finalize"):
        dump = tmp_path / f"{role}.json"

        class Dumping(RlhfProcessOperator):
            def build_command(self, context, dump=dump):
                super().build_command(context)
                return [sys.executable, "-c",
                        f"import json, os; json.dump(os.environ.get('CUDA_VISIBLE_DEVICES'), open({str(dump)!r}, 'w'))"]

        op = Dumping(task_id=role, role=role, run_url=run.url)
        super(RlhfProcessOperator, op).execute({"ti": None})  # the supervising part: start, stream, wait
        seen[role] = json.loads(dump.read_text())
    assert seen == {"sampler": "4,5", "trainer": "6,7", "finalize": "6,7"}
    trainer = RlhfProcessOperator(task_id="t", role="trainer", run_url=run.url).build_command({})
    assert "--nproc-per-node=2" in trainer


def test_airflow_sampler_replicas_on_one_worker_get_their_slice_and_memory_share(monkeypatch, tmp_path):
    """The mapped sampler tasks of `sampler.replicas` on one machine (LocalExecutor) split the
    sampling GPUs as the local runner's replicas do."""
    from pipeline.rundir import RunDir
    from plugins.operators import RlhfProcessOperator

    run = RunDir(f"file://{tmp_path}/r3")
    run.create(parse_config({"devices": {"sampler_share": 0.5}, "sampler": {"replicas": 3}}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    envs = [RlhfProcessOperator(task_id=f"s{i}", role="sampler", run_url=run.url, replica=i).process_environment({})
            for i in range(3)]
    assert envs == [{"CUDA_VISIBLE_DEVICES": "0", MEMORY_FRACTION_ENV: "0.450"},
                    {"CUDA_VISIBLE_DEVICES": "1", MEMORY_FRACTION_ENV: "0.900"},
                    {"CUDA_VISIBLE_DEVICES": "0", MEMORY_FRACTION_ENV: "0.450"}]


def test_an_engine_loads_with_the_collector_off_then_freezes_what_it_loaded(tmp_path):
    """`rlhf sampler|trainer` start with the cyclic collector off (pipeline.cli); `engine_loaded`
    freezes what start-up left alive and turns it back on, so that the loop's garbage is still
    collected. Run in a fresh interpreter: the test process's own collector stays as it is."""
    import subprocess

    code = """
import argparse, gc
from pipeline import cli
loaded = cli._engine(argparse.Namespace(after_prepare=False), ".devices", "engine_loaded")
assert not gc.isenabled()
libraries = [{"k": [i]} for i in range(50_000)]   # what start-up keeps
assert gc.get_freeze_count() == 0
loaded()
assert gc.isenabled() and gc.get_freeze_count() >= len(libraries)
cycle = []; cycle.append(cycle); del cycle         # garbage of the loop
assert gc.collect() >= 1
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
