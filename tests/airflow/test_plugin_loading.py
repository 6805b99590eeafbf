"""Airflow loads the plugin from the plugins folder, with the rest of the package ignored."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from airflow import plugins_manager
plugins, errors = plugins_manager._get_plugins()
fastapi_apps, _ = plugins_manager.get_fastapi_plugins()
print(json.dumps({"plugins": [p.name for p in plugins], "errors": errors,
                  "prefixes": [a["url_prefix"] for a in fastapi_apps],
                  "top_level": [m for m in ("__init__", "taskgroups", "run_dir", "app", "process", "retrain")
                                if m in sys.modules]}))
"""


def test_plugins_folder_yields_the_rlhf_plugin_without_import_errors(tmp_path):
    # A checkout that is not installed: only the plugins folder is on sys.path, as in Airflow.
    env = {"AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert result["plugins"] == ["rlhf"]
    assert result["prefixes"] == ["/rlhf"]
    assert result["top_level"] == []  # package modules are not loaded a second time as loose modules
