"""The last step of a run: evaluation + summary (engine), L3 compaction, the policy Asset event."""

from __future__ import annotations

from typing import Any, Sequence

from airflow.sdk.exceptions import AirflowException

from plugins.operators.rlhf import RlhfProcessOperator


def compact_buffer(run) -> dict:
    """The run is over: archive all of L1 into L3 (large zstd Parquet files, partitioned by policy
    version) and merge small L3 files, so the rollouts stay as a dataset for analysis or SFT/DPO."""
    from pipeline.buffer import ReplayBuffer

    return ReplayBuffer(run.buffer_url, run.config().buffer).compact(everything=True)


class FinalizeRunOperator(RlhfProcessOperator):
    """Runs `rlhf finalize` (held-out evaluation of the first and last policy, summary.json), then
    compacts the buffer into L3 and emits an event on each outlet Asset whose extra names the run
    and the exported model: the last published policy folder, a complete Hugging Face model.

    Returns `{run_id, run_url, policy_url, version, eval_after, compaction, summary}`.
    """

    template_fields: Sequence[str] = ("run_url", "extra_args", "env")

    def __init__(self, *, run_url: str, **kwargs: Any) -> None:
        super().__init__(role="finalize", run_url=run_url, **kwargs)

    def execute(self, context) -> dict:
        super().execute(context)
        from pipeline.policy import PolicyStore, version_dirname
        from pipeline.runs import RunDir

        run = RunDir(self.run_url)
        compaction = compact_buffer(run)
        self.log.info("buffer compaction into L3: %s", compaction)
        version = PolicyStore(run).latest()
        if version is None:
            raise AirflowException(f"{self.run_url} has no published policy to export")
        summary = run.read_json("summary.json") or {}
        extra = {"run_id": run.run_id, "run_url": run.url, "version": version,
                 "policy_url": run.child_url("policy", version_dirname(version)),
                 "eval_after": summary.get("eval_after")}
        for outlet in self.outlets:
            context["outlet_events"][outlet].extra = extra
        self.log.info("exported policy v%s: %s", version, extra["policy_url"])
        return {**extra, "compaction": compaction, "summary": summary}
