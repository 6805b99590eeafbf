"""Weekly retraining on the prompts of the run's date, from the last published policy.

Each run reads `<prompts_root>/ds=<YYYY-MM-DD>/*.parquet` for its logical date, starts from the
policy the latest earlier-dated run published (policy registry on storage; the form's model for
the first one), and writes to the run directory `rlhf_retrain-<date>` (`-2`, `-3`, ... when the
date is rerun with other parameters). `rlhf airflow backfill rlhf_retrain --from-date ... --to-date
...` (or `airflow backfill create ... --reprocess-behavior completed`) reruns past partitions,
including dates that already ran.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param, task

from plugins.dag_params import STORAGE_URL_PATTERN, run_params
from plugins.notifiers import RunFailureAlert
from plugins.taskgroups import training_run, watcher

DAG_ID = "rlhf_retrain"

with DAG(
    dag_id=DAG_ID,
    schedule="@weekly",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,  # each run starts from the policy the previous date published
    params={
        **run_params(with_dataset=False),
        "prompts_root": Param("", type="string", maxLength=1000, pattern=STORAGE_URL_PATTERN,
                              title="Dated prompts root",
                              description="fsspec URL holding ds=YYYY-MM-DD/*.parquet partitions "
                                          "(empty = $RLHF_PROMPTS_ROOT)"),
    },
    tags=["rlhf"],
    doc_md=__doc__,
    on_failure_callback=RunFailureAlert(),  # one alert per failed run (plugins/notifiers.py)
) as dag:

    @task(multiple_outputs=True, retries=1, retry_delay=timedelta(seconds=10))
    def prepare(params=None, dag_run=None, **context) -> dict:
        from plugins.dag_params import runs_root
        from plugins.retrain import partition_date, prepare_retrain, wait_for_earlier_run

        date = partition_date(context.get("logical_date"), dag_run)
        wait_for_earlier_run(context["ti"])
        return prepare_retrain(DAG_ID, dict(params), dag_run.conf, date, runs_root(params["storage_url"]),
                               dag_run_id=dag_run.run_id)

    @task(retries=1, retry_delay=timedelta(seconds=10))
    def register(finalized: dict, prepared: dict) -> dict:
        """Record the published policy so that the next date starts from it."""
        from plugins.retrain import register_policy

        return register_policy(DAG_ID, prepared, finalized)

    prepared = prepare()
    run = training_run(DAG_ID, prepared)
    register(run["finalize"].output, prepared)
    list(dag.tasks) >> watcher()
