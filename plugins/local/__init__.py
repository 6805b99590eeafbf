"""Airflow on one machine, for development, demos and tests: `rlhf airflow up|down|status|demo|backfill`.

- `folders`: where the DAGs, plugins and configs folders are (a checkout or an installed package).
- `client`: the REST client (urllib only).
- `deployment`: `LocalAirflow`, the api-server, scheduler, dag-processor and triggerer under one
  AIRFLOW_HOME with SQLite and LocalExecutor: environment, migration, up/down/status, backfill.
- `supervisor`: the process that runs those components and restarts one that exits
  (`python -m plugins.local.supervisor HOME`).
- `workers`: Celery workers as more supervised components, for `LocalAirflow` on Postgres with the
  CeleryExecutor (a small cluster on one machine: tests/cluster).
- `demo`: trigger `rlhf_train` and follow it.
- `cli`: the `rlhf airflow` command group, registered through the `rlhf.commands` entry point.

None of these modules imports Airflow: they start its CLI and talk to its REST API, so they
import without it. Airflow does not load them from the plugins folder (see `.airflowignore`).
"""
