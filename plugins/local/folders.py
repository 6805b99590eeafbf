"""Where the project's folders are: the same code in a checkout and installed from a wheel.

The distribution installs four top-level folders side by side: the packages `pipeline` and
`plugins`, and `dags` and `configs` (namespace packages, shipped with their files). In a checkout,
an editable install maps them to the repository's folders, which also lie side by side. So every
folder is found next to the `plugins` package itself, never from a module's position in a source
tree, and never from the current directory (where an unrelated `dags/` may lie).
"""

from __future__ import annotations

from pathlib import Path

import plugins


def plugins_folder() -> Path:
    """Airflow's PLUGINS_FOLDER: the `plugins` package (its `.airflowignore` keeps Airflow to
    `rlhf_plugin.py`)."""
    return Path(plugins.__file__).resolve().parent


def dags_folder() -> Path:
    """Airflow's DAGS_FOLDER: the `dags` folder installed with the project."""
    folder = plugins_folder().parent / "dags"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is missing: dags/ is installed with the `plugins` package "
                                "(pip install rlhf-pipeline, or pip install -e . in a checkout)")
    return folder


def configs_folder() -> Path:
    """The built-in run configs (`configs/*.yaml`) that the trigger form's `config_file` names,
    unless a deployment points RLHF_CONFIGS_DIR at a folder of its own."""
    return plugins_folder().parent / "configs"
