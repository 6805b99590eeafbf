"""The last step of a run: `rlhf finalize` (the engine's `orchestration.finalize`), then the policy
Asset event."""

from __future__ import annotations

from typing import Any, Sequence

from airflow.sdk.exceptions import AirflowException

from plugins.operators.rlhf import RlhfProcessOperator


class FinalizeRunOperator(RlhfProcessOperator):
    """Runs `rlhf finalize`, the step the local runner takes too (`orchestration.finalize`: the final
    policy verified against its manifest, held-out evaluation of the first and last policy, L1
    compacted into L3, summary.json), then emits an event on each outlet Asset whose extra names the
    run and the exported model: the last published policy folder, a complete Hugging Face model.

    Returns `{run_id, run_url, policy_url, version, eval_after, compaction, summary}`.
    """

    template_fields: Sequence[str] = ("run_url", "extra_args", "env")

    def __init__(self, *, run_url: str, **kwargs: Any) -> None:
        super().__init__(role="finalize", run_url=run_url, **kwargs)

    def execute(self, context) -> dict:
        super().execute(context)
        from pipeline.policy import PolicyStore, version_dirname
        from pipeline.rundir import RunDir

        run = RunDir(self.run_url)
        version = PolicyStore(run).latest()
        if version is None:
            raise AirflowException(f"{self.run_url} has no published policy to export")
        summary = run.read_json("summary.json") or {}
        self.log.info("buffer compaction into L3: %s", summary.get("compaction"))
        extra = {"run_id": run.run_id, "run_url": run.url, "version": version,
                 "policy_url": run.child_url("policy", version_dirname(version)),
                 "eval_after": summary.get("eval_after")}
        for outlet in self.outlets:
            context["outlet_events"][outlet].extra = extra
        self.log.info("exported policy v%s: %s", version, extra["policy_url"])
        return {**extra, "compaction": summary.get("compaction"), "summary": summary}
