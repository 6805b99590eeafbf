"""The task graph of one RLHF training run, shared by `rlhf_train` and `rlhf_retrain`.

    prepare ─┬─► sampler                        (runs until the stop marker appears)
             ├─► trainer ──────────────────────┬─► stop_sampler (teardown: writes the stop marker)
             ├─► phase[k]: wait_checkpoint ─► reshard ─┐
             ├─► replay_gate[e] ───────────────────────┴─► finalize (after the trainer too; Asset event)
    every task ─► watcher (fails the run when any task failed)

Clearing a failed run (all its tasks, or only the failed ones) resumes it: the stop marker the
teardown wrote names the attempt it ended, the sampler and trainer tasks of a later attempt remove
it before their processes start, sensors ignore it, and the trainer resumes from its last
checkpoint. The sampler stopped that way and the teardown fail, so "only failed" clears them
too. Clearing the trainer task alone (with its downstream: finalize, stop_sampler, watcher) resumes
the trainer, but neither the sampler nor the failed sensors are downstream of it: clear those too.

Phases and replay epochs are run parameters, so their tasks are mapped over the lists `prepare`
returns (dynamic task mapping) rather than generated when the file is parsed. The engine is
imported inside the task functions only: parsing a DAG file never loads torch or pyarrow.
"""

from __future__ import annotations

import os
from datetime import timedelta

from airflow.sdk import Asset, task, task_group, teardown
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from pipeline.devices import DEVICE_POOL
from plugins.operators.finalize import FinalizeRunOperator
from plugins.operators.rlhf import RlhfProcessOperator
from plugins.pod_override import device_task_kwargs
from plugins.sensors.run_dir import PhaseCheckpointSensor, ReplayGateSensor

# The device pool (pipeline.devices.DEVICE_POOL) has one slot per accelerator of the deployment.
# On CeleryExecutor deployments, device-heavy tasks go to the workers that own the accelerators
# (docker/compose.yaml: RLHF_DEVICE_QUEUE=gpu); unset, they use the executor's default queue.
DEVICE_QUEUE = os.environ.get("RLHF_DEVICE_QUEUE") or None
# Slots of the device pool one run holds (its trainer task, for the whole run): the accelerators a
# run uses, e.g. 8 for runs that each take an 8-GPU worker. The pool's size is the deployment's
# accelerator count, so runs that do not fit wait for one to finish (plugins/operators/rlhf.py).
RUN_SLOTS = max(1, int(os.environ.get("RLHF_RUN_DEVICE_SLOTS") or 1))
RUN_TIMEOUT = timedelta(hours=12)
PROCESS_RETRIES = 2
SENSOR_RETRIES = 2
# The phase and replay-gate sensors defer as soon as prepare is done and count their timeout from
# there, while the trainer may first wait its turn for the device pool and then take every try
# (RUN_TIMEOUT each). A trainer that ends without their marker writes the stop marker (teardown),
# which fails them at once; this bound is only the last resort.
SENSOR_TIMEOUT = RUN_TIMEOUT * (PROCESS_RETRIES + 1) + timedelta(days=7)


def policy_asset(dag_id: str) -> Asset:
    """The published policy of a DAG's runs; each event's extra names the run and the version."""
    return Asset(name=f"{dag_id}.policy", uri=f"rlhf-policy://{dag_id}")


@task(retries=SENSOR_RETRIES, retry_delay=timedelta(seconds=5))
def reshard(checkpoint: dict) -> dict:
    """Trainer layout -> sampler layout, committed atomically as policy v<step>, then verified
    against its manifest: `orchestration.publish_phase`, the step the local runner takes too.
    Idempotent on retry."""
    from pipeline import orchestration
    from pipeline.rundir import RunDir

    out = orchestration.publish_phase(RunDir(checkpoint["run_url"]), checkpoint["phase"], checkpoint["step"],
                                      checkpoint["checkpoint"])
    print(f"phase {out['phase']}: policy v{out['version']} "
          f"{'published' if out['published_now'] else 'already published'} from {checkpoint['checkpoint']} "
          f"and verified ({out['files']} files)")
    return out


@task_group(group_id="phase")
def phase_group(phase: int, run_url: str, poke_interval: float) -> None:
    ready = PhaseCheckpointSensor(task_id="wait_checkpoint", run_url=run_url, phase=phase,
                                  poke_interval=poke_interval, timeout=SENSOR_TIMEOUT.total_seconds(),
                                  retries=SENSOR_RETRIES, retry_delay=timedelta(seconds=5))
    reshard(ready.output)


def _stop_sampler(run_url: str, dag_run=None) -> str:
    """Ask the sampler to stop once the trainer task is over, whatever its outcome. Waiting sensors
    see the stop marker too, so a failed trainer fails them instead of leaving them waiting.

    After a trainer that did not finish, the stop names this attempt of the DAG run (its clear
    count): clearing the failed run starts a later attempt, for which this stop is stale, so the
    cleared sampler, trainer and sensors resume instead of stopping at once. This task then fails
    (having stopped the run), so that clearing only the failed tasks runs it again after the
    resumed trainer."""
    from pipeline import orchestration
    from pipeline.rundir import RunDir

    from plugins.hooks.run_dir import run_attempt

    run = RunDir(run_url)
    stop = orchestration.stop_after_trainer(run, by="stop_sampler", attempt=run_attempt({"dag_run": dag_run}),
                                            unfinished="trainer task ended without finishing")
    if stop.get("attempt") is not None and not run.has_marker(run.TRAINER_DONE_MARKER):
        raise AirflowFailException(f"stopped the run: the {stop.get('reason')}; clear this DAG run's failed tasks "
                                   "(or the whole run) to resume it from the trainer's last checkpoint")
    return run_url


# Mapping needs a task's return value (not one key of a multiple-output XCom): `plan_<list>` tasks
# pass on the lists prepare computed from the validated config (phases, replay epochs, sampler
# replicas, trainer nodes 1..M-1; node 0 is the `trainer` task).
@task(retries=1)
def _plan(items: list[int]) -> list[int]:
    return list(items)


def plan(prepared, key: str):
    """The `plan_<key>` task over prepare's list `key`."""
    return _plan.override(task_id=f"plan_{key}")(prepared[key])


@task(trigger_rule="one_failed", retries=0)
def watcher() -> None:
    """Airflow leaves teardown tasks out when it decides a run's state, and a run whose work failed
    may still end with a successful teardown: this task makes the DAG run fail then."""
    raise AirflowException("a task of this run failed; see the failed task's log")


def training_run(dag_id: str, prepared, *, poke_interval: float = 5.0) -> dict:
    """Wire sampler, trainer, phases, replay gates, finalize and the teardown after `prepared`
    (the multiple-output XCom of the prepare task: run_url, phases, replay_epochs)."""
    run_url = prepared["run_url"]
    device = {"pool": DEVICE_POOL, **({"queue": DEVICE_QUEUE} if DEVICE_QUEUE else {})}
    common = dict(**device, execution_timeout=RUN_TIMEOUT, retries=PROCESS_RETRIES,
                  retry_delay=timedelta(seconds=10))
    # On Kubernetes each device task runs in a pod of its own (plugins/pod_override.py); else {}.
    # Gang scheduling (RlhfProcessOperator): the trainer holds the pool slots of the whole run; the
    # sampler replicas and the other trainer nodes take none and start once it runs.
    gang = {k: v for k, v in common.items() if k != "pool"}
    sampler = RlhfProcessOperator.partial(
        task_id="sampler", role="sampler", run_url=run_url, wait_for_trainer=True, **gang,
        **device_task_kwargs("sampler")).expand(replica=plan(prepared, "samplers"))
    trainer = RlhfProcessOperator(task_id="trainer", role="trainer", run_url=run_url, pool_slots=RUN_SLOTS, **common,
                                  **device_task_kwargs("trainer"))
    trainer_nodes = RlhfProcessOperator.partial(
        task_id="trainer_node", role="trainer", run_url=run_url, wait_for_trainer=True, **gang,
        **device_task_kwargs("trainer")).expand(node=plan(prepared, "trainer_nodes"))
    phases = phase_group.partial(run_url=run_url, poke_interval=poke_interval).expand(
        phase=plan(prepared, "phases"))
    gates = ReplayGateSensor.partial(
        task_id="replay_gate", run_url=run_url, poke_interval=poke_interval,
        timeout=SENSOR_TIMEOUT.total_seconds(), retries=SENSOR_RETRIES, retry_delay=timedelta(seconds=5),
    ).expand(epoch=plan(prepared, "replay_epochs"))
    finalize = FinalizeRunOperator(task_id="finalize", run_url=run_url, outlets=[policy_asset(dag_id)],
                                   **device, pool_slots=RUN_SLOTS, **device_task_kwargs("finalize"),
                                   execution_timeout=timedelta(hours=2), retries=1,
                                   # With replay_epochs=0 the gate mapping is empty, hence skipped:
                                   # that must not skip finalize. A failure upstream still does.
                                   trigger_rule="none_failed",
                                   retry_delay=timedelta(seconds=10))
    # A fresh teardown per DAG: the decorator keeps state between calls.
    stop = teardown(task(task_id="stop_sampler")(_stop_sampler))(run_url)
    [trainer, trainer_nodes, phases, gates] >> finalize
    trainer >> stop
    return {"sampler": sampler, "trainer": trainer, "trainer_nodes": trainer_nodes, "phases": phases, "gates": gates,
            "finalize": finalize, "stop": stop}


def prepare_run(dag_id: str, params: dict, conf: dict | None, run_name: str, extra: dict | None = None,
                *, rerun_suffix: bool = False, dag_run_id: str | None = None) -> dict:
    """Body of a DAG's prepare task: the form -> a validated config -> `orchestration.prepare` (run
    directory, prompts, policy v0) -> the XCom the graph is mapped over.

    `extra` holds config keys the DAG decides itself (e.g. the retrain's dated prompts), applied
    over the form. Idempotent: a retried prepare finds the same run directory and config. With
    `rerun_suffix`, a run directory `run_name` that holds another config (the same date rerun with
    other parameters) is kept, and the run goes to `run_name-2`, `-3`, ... instead. `dag_run_id`:
    the DAG run that drives the run directory from now on (`RunDir.take_over`).
    """
    from pipeline import orchestration
    from pipeline.config_yaml import apply_overrides
    from pipeline.rundir import run_url_for

    from plugins.dag_params import build_config, runs_root

    config = build_config(params, conf, run_name)
    if extra:
        from pipeline.config import parse_config

        data = apply_overrides(config.model_dump(mode="json"), [f"{k}={_json(v)}" for k, v in extra.items()])
        config = parse_config(data)
    root = runs_root(params.get("storage_url") or "")
    n_phases = int(getattr(config.trainer, "phases", 1) or 1)
    n_epochs = int(getattr(config.trainer, "replay_epochs", 0) or 0)
    _check_mappable({"trainer.phases": n_phases, "trainer.replay_epochs": n_epochs})
    if rerun_suffix:
        run_name = _unused_or_same(root, run_name, config)
    run = orchestration.prepare(config, run_url_for(root, run_name))
    if dag_run_id is not None:
        removed = run.take_over(dag_run_id)
        if removed:
            print(f"{dag_id}: {run.url} was driven by another DAG run; its markers {', '.join(removed)} removed")
    print(f"{dag_id}: run directory {run.url} ({n_phases} phases, {n_epochs} replay epochs)")
    return {"run_url": run.url, "run_id": run.run_id, "phases": list(range(n_phases)),
            "replay_epochs": list(range(n_epochs)), "samplers": list(range(config.sampler.replicas)),
            "trainer_nodes": list(range(1, config.trainer.nnodes))}


def _check_mappable(counts: dict[str, int]) -> None:
    """Each phase and replay epoch is a mapped task: more than Airflow's [core] max_map_length of
    them would fail the plan task after the run directory exists. Refused here, before it does."""
    from airflow.configuration import conf

    limit = conf.getint("core", "max_map_length", fallback=1024)
    for key, n in counts.items():
        if n > limit:
            raise ValueError(f"{key}={n}: each is a mapped task, and Airflow maps at most {limit} "
                             "([core] max_map_length); use fewer")


def _unused_or_same(root: str, run_name: str, config) -> str:
    """`run_name`, or the first of `run_name-2`, `-3`, ... that is unused or holds this run (the
    same config, perhaps at another scale: `pipeline.rundir.same_run`, the rule prepare applies)."""
    from pipeline.rundir import RunDir, run_url_for, same_run

    for n in range(1, 1000):
        name = run_name if n == 1 else f"{run_name}-{n}"
        run = RunDir(run_url_for(root, name))
        if not run.exists():
            return name
        if same_run(run.config(), config.model_copy(update={"run_id": run.run_id})):
            return name
    raise ValueError(f"{run_name}: 999 reruns with other configs already exist under {root}")


def _json(value) -> str:
    import json

    return json.dumps(value)
