"""Airflow-specific pieces of the RLHF pipeline: operators, sensors, triggers, hooks, the plugin.

Importable in two ways: as the installed package `plugins` (workers, triggerer, tests), and from
Airflow's plugins folder, where `rlhf_plugin.py` is the only module Airflow loads itself (see
`.airflowignore`). Nothing here is imported by the engine (`pipeline/`).
"""
