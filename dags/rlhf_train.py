"""RL post-training of a language model, started from the trigger form.

prepare -> sampler and trainer in parallel (long-running, supervised subprocesses) -> per phase a
checkpoint sensor and a reshard task -> per replay epoch a replay-gate sensor -> finalize (held-out
eval, L3 compaction, an Asset event for the published policy) -> stop the sampler. The watcher
fails the run when any task failed. See plugins/taskgroups.py for the graph.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, task

from plugins.dag_params import run_params
from plugins.notifiers import RunFailureAlert
from plugins.taskgroups import training_run, watcher

DAG_ID = "rlhf_train"

with DAG(
    dag_id=DAG_ID,
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=2,
    params=run_params(),
    tags=["rlhf"],
    doc_md=__doc__,
    on_failure_callback=RunFailureAlert(),  # one alert per failed run (plugins/notifiers.py)
) as dag:

    @task(multiple_outputs=True, retries=1, retry_delay=timedelta(seconds=10))
    def prepare(params=None, dag_run=None) -> dict:
        """Validate the form (again) through the engine's config loader and create the run."""
        from plugins.dag_params import run_name_from
        from plugins.taskgroups import prepare_run

        name = params["run_name"] or run_name_from(DAG_ID, dag_run.run_id)
        return prepare_run(DAG_ID, dict(params), dag_run.conf, name, dag_run_id=dag_run.run_id)

    training_run(DAG_ID, prepare())
    list(dag.tasks) >> watcher()
