"""Alerts: a failed run and a stalled trainer notify a person, through Airflow's notifiers.

Two events raise an alert:

- `run_failed`: the DAG's `on_failure_callback` (`RunFailureAlert`), which Airflow calls once
  when the DAG run fails, after the retries of its tasks are spent (task retries never notify);
- `trainer_stalled`: the trainer task saw no new trainer step for `trainer.stall_timeout_s`; it
  notifies, stops the trainer's process group and fails, so that its retries take over
  (`plugins/operators/rlhf.py`).

The deployment chooses where alerts go, with the environment variable `RLHF_NOTIFIER` of the
Airflow components (or else the Airflow Variable `rlhf_notifier`):

    log                          (default) one WARNING line in the log of the process that notifies
    file:/var/log/rlhf/alerts.jsonl   one JSON line per alert, appended (an audit trail)
    smtp:oncall@example.com,ml@example.com   the SMTP provider's SmtpNotifier (connection smtp_default)
    slack:#rlhf-alerts           the Slack provider's SlackNotifier (connection slack_api_default),
                                 where apache-airflow-providers-slack is installed

A notifier that cannot be built (a provider that is not installed, a bad spec) falls back to
`log`, with an error naming the spec, so an alert is never lost silently.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from urllib.parse import quote

from airflow.sdk import BaseNotifier

ENV_VAR = "RLHF_NOTIFIER"
VARIABLE = "rlhf_notifier"
log = logging.getLogger("rlhf.alerts")


def alert_text(alert: dict) -> tuple[str, str]:
    """(subject, body) of an alert."""
    what = {"run_failed": "failed", "trainer_stalled": "trainer stalled"}.get(alert["event"], alert["event"])
    subject = f"[rlhf] {alert.get('dag_id')} run {alert.get('run_id')}: {what}"
    lines = [f"{k}: {alert[k]}" for k in ("task_id", "try_number", "failed_task", "reason", "dashboard")
             if alert.get(k)]
    return subject, "\n".join(lines)


class _AlertNotifier(BaseNotifier):
    """A notifier that holds its finished text: nothing to render (and no DAG needed for it)."""

    def render_template_fields(self, context, jinja_env=None) -> None:
        if self.template_fields:
            super().render_template_fields(context, jinja_env)


class LogNotifier(_AlertNotifier):
    """Writes the alert as one WARNING line of the `rlhf.alerts` logger."""

    def __init__(self, alert: dict):
        super().__init__()
        self.alert = alert

    def notify(self, context) -> None:
        subject, body = alert_text(self.alert)
        log.warning("%s; %s", subject, body.replace("\n", "; "))


class FileNotifier(_AlertNotifier):
    """Appends the alert as one JSON line to a file (created with its folder if missing)."""

    def __init__(self, path: str, alert: dict):
        super().__init__()
        self.path = path
        self.alert = alert

    def notify(self, context) -> None:
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(self.alert, sort_keys=True, default=str) + "\n")


def configured_spec() -> str:
    spec = os.environ.get(ENV_VAR, "").strip()
    if spec:
        return spec
    try:
        from airflow.sdk import Variable

        return str(Variable.get(VARIABLE, default="") or "").strip() or "log"
    except Exception:  # no metadata database or API to ask (a bare process): the default
        return "log"


def build_notifier(spec: str, alert: dict) -> BaseNotifier:
    """The notifier `spec` names (see the module docstring), holding `alert`."""
    kind, _, arg = spec.partition(":")
    subject, body = alert_text(alert)
    if kind == "log":
        return LogNotifier(alert)
    if kind == "file" and arg:
        return FileNotifier(arg, alert)
    if kind == "smtp" and arg:
        from airflow.providers.smtp.notifications.smtp import SmtpNotifier

        return SmtpNotifier(to=[a.strip() for a in arg.split(",") if a.strip()], subject=subject,
                            html_content="<pre>" + body.replace("<", "&lt;") + "</pre>")
    if kind == "slack" and arg:
        from airflow.providers.slack.notifications.slack import SlackNotifier

        return SlackNotifier(channel=arg, text=f"{subject}\n{body}")
    raise ValueError(f"{ENV_VAR}={spec!r}: use log, file:PATH, smtp:ADDRESS[,ADDRESS] or slack:#CHANNEL")


def send(alert: dict, context=None, spec: str | None = None) -> None:
    """Deliver `alert` through the deployment's notifier (`spec`, else `configured_spec()`); the
    log notifier when that one cannot be built."""
    spec = spec or configured_spec()
    try:
        notifier = build_notifier(spec, alert)
    except (ImportError, ValueError) as e:
        log.error("alert notifier %r unusable (%s); logging the alert instead", spec, e)
        notifier = LogNotifier(alert)
    # without the DAG: a provider's notifier renders its (already final) text with a plain jinja
    # environment, whichever form of the DAG (SDK or serialized) the caller's context holds
    notifier({k: v for k, v in dict(context or {}).items() if k != "dag"})


def dashboard_url(dag_id: str, run_id: str) -> str:
    try:
        from airflow.configuration import conf

        base = conf.get("api", "base_url", fallback="") or ""
    except Exception:
        base = ""
    return f"{base.rstrip('/')}/rlhf/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def make_alert(event: str, context, reason: str = "") -> dict:
    dag_run = context.get("dag_run") if context else None
    ti = context.get("ti") or context.get("task_instance") if context else None
    dag = context.get("dag") if context else None
    dag_id = getattr(dag_run, "dag_id", None) or getattr(dag, "dag_id", None) or getattr(ti, "dag_id", None)
    run_id = getattr(dag_run, "run_id", None) or (context or {}).get("run_id") or getattr(ti, "run_id", None)
    alert = {"event": event, "dag_id": dag_id, "run_id": run_id, "time": time.time(), "reason": reason}
    if ti is not None and event != "run_failed":
        alert.update(task_id=getattr(ti, "task_id", None), try_number=getattr(ti, "try_number", None))
    if dag_id and run_id:
        alert["dashboard"] = dashboard_url(str(dag_id), str(run_id))
    return alert


class RunFailureAlert(_AlertNotifier):
    """A DAG's `on_failure_callback`: one `run_failed` alert through the deployment's notifier.

    Airflow calls a DAG's failure callback once per failed DAG run; task retries do not."""

    def notify(self, context) -> None:
        # Airflow passes the context of the task instance that decided the run's state
        ti = context.get("ti") or context.get("task_instance")
        reason = str(context.get("reason") or "")
        alert = make_alert("run_failed", context, reason)
        if getattr(ti, "task_id", None):
            alert["failed_task"] = ti.task_id
            alert["reason"] = f"{reason}; failed task: {ti.task_id}".lstrip("; ")
        send(alert, context)


def notify_stall(context, reason: str, spec: str | None = None) -> dict:
    """A `trainer_stalled` alert for the task of `context`; returns the alert sent."""
    alert = make_alert("trainer_stalled", context, reason)
    send(alert, context, spec)
    return alert
