"""Airflow tests run against a throw-away AIRFLOW_HOME (set before anything imports airflow)."""

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_HOME = tempfile.mkdtemp(prefix="airflow-test-home-")
os.environ.setdefault("AIRFLOW_HOME", _HOME)
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(REPO / "dags"))
os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", str(REPO / "plugins"))
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
os.environ.setdefault("AIRFLOW__API_AUTH__JWT_SECRET", "test-secret-" + "x" * 64)
os.environ.setdefault("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "admin:admin,viewer:viewer")
