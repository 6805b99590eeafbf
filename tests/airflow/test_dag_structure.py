"""The wiring of the RLHF DAGs: which task waits for which, what is mapped, how tasks are guarded."""

import importlib.util
from datetime import timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_dag(name):
    spec = importlib.util.spec_from_file_location(f"dag_{name}", REPO / "dags" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


@pytest.fixture(scope="module", params=["rlhf_train", "rlhf_retrain"])
def dag(request):
    return load_dag(request.param)


def upstream(dag, task_id):
    return set(dag.get_task(task_id).upstream_task_ids)


def test_sampler_and_trainer_start_together_after_prepare(dag):
    assert upstream(dag, "sampler") == {"prepare", "plan_samplers"}
    assert upstream(dag, "trainer") == {"prepare"}
    assert upstream(dag, "trainer_node") == {"prepare", "plan_trainer_nodes"}


def test_sampler_replicas_and_trainer_nodes_are_mapped_over_prepares_lists(dag):
    for task_id, plan in (("sampler", "plan_samplers"), ("trainer_node", "plan_trainer_nodes")):
        assert dag.get_task(task_id).is_mapped
        assert upstream(dag, plan) == {"prepare"}
    assert not dag.get_task("trainer").is_mapped  # node 0, which holds the run's device slots


def test_each_phase_is_a_mapped_sensor_then_reshard_over_prepares_list(dag):
    from airflow.sdk.definitions.taskgroup import MappedTaskGroup

    group = dag.task_group_dict["phase"]
    assert isinstance(group, MappedTaskGroup)
    assert upstream(dag, "phase.reshard") == {"phase.wait_checkpoint"}
    assert "plan_phases" in upstream(dag, "phase.wait_checkpoint")
    assert upstream(dag, "plan_phases") == {"prepare"}


def test_replay_gates_are_mapped_over_the_epoch_list(dag):
    gate = dag.get_task("replay_gate")
    assert gate.is_mapped
    assert "plan_replay_epochs" in upstream(dag, "replay_gate")


def test_finalize_waits_for_trainer_reshards_and_gates_and_emits_the_policy_asset(dag):
    assert {"trainer", "phase.reshard", "replay_gate"} <= upstream(dag, "finalize")
    # an empty mapping (replay_epochs=0) is skipped; finalize must still run, but not after a failure
    assert dag.get_task("finalize").trigger_rule == "none_failed"
    outlets = dag.get_task("finalize").outlets
    assert [a.name for a in outlets] == [f"{dag.dag_id}.policy"]


def test_teardown_stops_the_sampler_after_the_trainer_whatever_its_outcome(dag):
    stop = dag.get_task("stop_sampler")
    assert stop.is_teardown
    assert "trainer" in stop.upstream_task_ids
    assert "sampler" not in stop.upstream_task_ids  # the sampler runs until it is stopped


def test_watcher_follows_every_task_and_fires_on_one_failure(dag):
    watcher = dag.get_task("watcher")
    assert watcher.trigger_rule == "one_failed"
    assert watcher.upstream_task_ids == {t.task_id for t in dag.tasks} - {"watcher"}


def test_long_running_tasks_have_pool_timeout_and_resuming_retries(dag):
    from plugins.taskgroups import RUN_SLOTS

    for task_id in ("sampler", "trainer", "trainer_node", "finalize"):
        t = dag.get_task(task_id)
        assert t.execution_timeout is not None and t.execution_timeout <= timedelta(days=1)
        assert t.retries >= 1
    # gang scheduling: the trainer holds the run's device slots; samplers and other nodes wait for it
    for task_id in ("trainer", "finalize"):
        assert dag.get_task(task_id).pool == "rlhf_devices"
        assert dag.get_task(task_id).pool_slots == RUN_SLOTS
    for task_id in ("sampler", "trainer_node"):
        t = dag.get_task(task_id)
        assert t.pool != "rlhf_devices"
        assert t.partial_kwargs["wait_for_trainer"] is True


def test_sensors_defer_and_retry(dag):
    trainer = dag.get_task("trainer")
    for task_id in ("phase.wait_checkpoint", "replay_gate"):
        t = dag.get_task(task_id)
        kwargs = t.partial_kwargs if t.is_mapped else t.__dict__
        assert kwargs["retries"] >= 1
        # they wait from prepare on: longer than every try of the trainer, whose clock starts later
        assert kwargs.get("timeout", getattr(t, "timeout", None)) > (
            trainer.execution_timeout * (trainer.retries + 1)).total_seconds()


def test_train_is_manual_and_retrain_is_weekly_without_catchup():
    train, retrain = load_dag("rlhf_train"), load_dag("rlhf_retrain")
    assert train.schedule is None
    assert retrain.schedule == "@weekly"
    assert retrain.catchup is False
    assert retrain.max_active_runs == 1
    assert upstream(retrain, "register") == {"finalize", "prepare"}


def test_form_accepts_good_values_and_rejects_bad_ones_by_schema():
    import copy

    from airflow.sdk.exceptions import ParamValidationError

    dag = load_dag("rlhf_train")

    def resolve(key, value):
        return copy.deepcopy(dag.params.get_param(key)).resolve(value)

    assert resolve("steps", 5) == 5
    assert resolve("phases", None) is None  # empty = keep the config file's value
    assert resolve("sampler_backend", "vllm") == "vllm"
    assert resolve("run_name", "exp-1.a") == "exp-1.a"
    for key, bad in (("steps", 0), ("sampler_backend", "tgi"), ("run_name", "../etc"),
                     ("config_file", "a/b.yaml"), ("replay_epochs", -1), ("overrides", "trainer.lr=1")):
        with pytest.raises(ParamValidationError):
            resolve(key, bad)
