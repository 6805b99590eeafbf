"""The run dashboard: a FastAPI app that Airflow's api-server mounts under /rlhf.

Airflow serves plugin apps without authentication, so every route here depends on Airflow's own
security dependency (a JWT as `Authorization: Bearer ...` or the UI's session cookie, then the auth
manager's permission to read runs of that DAG). Unauthenticated requests get 401.

A DAG run is found through the XCom `run_url` of its `prepare` task, never through a URL taken
from the request, so the dashboard only ever reads run directories the DAG itself created.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse

from plugins.dashboard.page import render_page

URL_PREFIX = "/rlhf"
PREPARE_TASK_ID = "prepare"
RUN_URL_KEY = "run_url"

RunLocator = Callable[[str, str], "str | None"]


def xcom_run_url(dag_id: str, run_id: str) -> str | None:
    """The run directory of a DAG run, as its prepare task published it (None if not prepared)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(run_id=run_id, key=RUN_URL_KEY, task_ids=PREPARE_TASK_ID, dag_ids=dag_id, limit=1)
        ).first()
        return XComModel.deserialize_value(row) if row is not None else None


def get_locator() -> RunLocator:
    return xcom_run_url


def dag_run_state(dag_id: str, run_id: str) -> str | None:
    """The DAG run's state in the metadata database (queued, running, success, failed), or None."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        state = session.scalar(select(DagRun.state).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
        return str(state.value if hasattr(state, "value") else state) if state is not None else None


def get_state_lookup() -> Callable[[str, str], "str | None"]:
    return dag_run_state


async def require_run_read_access(request: Request) -> None:
    """Airflow authentication and authorization for every route of this app.

    The same checks as the api-server's own routes (Airflow's `resolve_user_from_token`, then the
    auth manager's `is_authorized_dag` for reading runs of the path's DAG), imported on first use
    so that loading the plugin in a scheduler or worker does not pull in the API server.
    """
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
    from airflow.api_fastapi.core_api.security import resolve_user_from_token

    header = request.headers.get("authorization", "")
    scheme, _, credentials = header.partition(" ")
    token = credentials.strip() if scheme.lower() == "bearer" else request.cookies.get(COOKIE_NAME_JWT_TOKEN)
    user = await resolve_user_from_token(token)  # 401 without a token, 403 for an invalid one
    dag_id = request.path_params.get("dag_id")
    allowed = get_auth_manager().is_authorized_dag(
        method="GET", access_entity=DagAccessEntity.RUN, details=DagDetails(id=dag_id), user=user)
    if not allowed:
        raise HTTPException(status_code=403, detail=f"not allowed to read runs of {dag_id!r}")


def _status(dag_id: str, run_id: str, locate: RunLocator, state_of=None) -> dict:
    from plugins.hooks.run_dir import RunDirHook

    run_url = locate(dag_id, run_id)
    state = state_of(dag_id, run_id) if state_of is not None else None
    if not run_url:
        raise HTTPException(status_code=404, detail=f"run {run_id!r} of {dag_id!r} has no run directory yet"
                                                     + (f" (DAG run {state})" if state else ""))
    from pipeline.config import ConfigError

    try:
        status = RunDirHook(run_url).status()
    except FileNotFoundError as e:
        raise HTTPException(status_code=404, detail=f"run directory {run_url} is incomplete: {e}") from None
    except ConfigError as e:  # e.g. a run created by an older engine version
        raise HTTPException(status_code=409, detail=f"run directory {run_url}: {e}") from None
    return {"dag_id": dag_id, "dag_run_id": run_id, "state": state, **status}


def create_app() -> FastAPI:
    app = FastAPI(title="RLHF run dashboard", description="Run status, buffer tiers, curves and phases")
    guard = [Depends(require_run_read_access)]

    @app.get("/api/dags/{dag_id}/runs/{run_id}/status", dependencies=guard)
    async def run_status(dag_id: str, run_id: str, locate: RunLocator = Depends(get_locator),
                         state_of=Depends(get_state_lookup)) -> dict:
        """Run status as JSON: the DAG run's state, config, phases and gates, policy versions,
        buffer tiers, curves, and the chart data of the page (`charts`)."""
        return await asyncio.to_thread(_status, dag_id, run_id, locate, state_of)

    @app.get("/dags/{dag_id}/runs/{run_id}", response_class=HTMLResponse, dependencies=guard)
    async def run_page(dag_id: str, run_id: str, request: Request) -> HTMLResponse:
        """The HTML dashboard; its script polls the JSON endpoint above with the same credentials."""
        status_url = str(request.url_for("run_status", dag_id=dag_id, run_id=run_id).path)
        return HTMLResponse(render_page(dag_id, run_id, status_url))

    return app
