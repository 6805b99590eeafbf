"""Airflow plugin entry point: the RLHF run dashboard (FastAPI app) and its link on each DAG run.

Airflow loads this file from its plugins folder as a top-level module. The rest of the `plugins`
package is imported by name, which needs the folder's parent on sys.path: true when the project is
installed (pip install -e . / the Docker image); otherwise added here.
"""

from __future__ import annotations

import os
import sys

try:
    import plugins.dashboard  # noqa: F401
except ImportError:  # loaded from the plugins folder of a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from airflow.plugins_manager import AirflowPlugin

from plugins.dashboard import URL_PREFIX, create_app


class RlhfPlugin(AirflowPlugin):
    name = "rlhf"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "RLHF run dashboard"}]
    external_views = [{
        "name": "RLHF dashboard",
        "href": URL_PREFIX + "/dags/{DAG_ID}/runs/{RUN_ID}",
        "destination": "dag_run",
        "url_route": "rlhf_dashboard",
    }]
