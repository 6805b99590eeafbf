"""The one place where Airflow code reads a run directory.

Sensors, triggers and the dashboard all ask the same questions of a run (has phase k finished?
is replay gate e ready? what do the curves look like?). They ask them here, and the hook answers
with the engine's own functions: marker names from `RunDir`, the run's steps (the replay-gate
condition among them) from `pipeline.orchestration`. Every method is synchronous and does
blocking fsspec I/O: triggers call them through `asyncio.to_thread`.
"""

from __future__ import annotations

import threading
from typing import Any

from airflow.sdk import BaseHook

from plugins.dashboard.series import KeptPerRun

# Metric keys plotted by the dashboard: (x key, y keys) per kind of metrics stream.
CURVES = {
    "trainer": ("step", ("reward/mean", "reward/std", "actor/loss", "actor/entropy", "perf/tokens_per_s",
                         "staleness/mean", "staleness/max", "replay/fraction")),
    "sampler": ("sampler/batch", ("reward/mean", "perf/gen_tokens_per_s", "sampler/policy_version",
                                  "timing_s/reload")),
}
MAX_POINTS = 400


def run_attempt(context) -> int | None:
    """The attempt of the DAG run a task belongs to: how many times it was cleared (0 at first).
    Stop markers carry it (see `RunDir.request_stop`). None outside a task (a bare context)."""
    dag_run = context.get("dag_run") if context else None
    number = getattr(dag_run, "clear_number", None)
    return int(number) if number is not None else None


def _downsample(points: list, limit: int = MAX_POINTS) -> list:
    if len(points) <= limit:
        return points
    stride = len(points) / limit
    picked = [points[int(i * stride)] for i in range(limit - 1)]
    return picked + [points[-1]]


class _Readers(KeptPerRun):
    """What the dashboard reads of one run again at every poll, kept between polls for the
    `MAX_RUNS` runs viewed last: a `StreamReader` per metrics stream (each poll parses only the
    records logged since the last) and the run's `ReplayBuffer` (each poll replays only the log
    entries committed since the last). Without them a poll re-read every stream and the whole log:
    O(steps) a poll, 5 s apart, for as long as the page is open. Keyed by the run's URL and the
    time its directory was first prepared: a run directory deleted and made again at the same URL
    is another run, read from its start."""

    def __init__(self) -> None:
        self.streams: dict = {}
        self.buffer = None
        self.lock = threading.Lock()  # polls of one run (two open pages) take turns


class RunDirHook(BaseHook):
    """Read-mostly access to one run directory (any fsspec URL)."""

    def __init__(self, run_url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not run_url:
            raise ValueError("run_url is empty; pass the URL returned by the prepare task")
        self.run_url = run_url
        self._run = None

    @property
    def run(self):
        if self._run is None:
            from pipeline.rundir import RunDir

            self._run = RunDir(self.run_url)
        return self._run

    # markers ---------------------------------------------------------------------------------
    def marker(self, name: str) -> dict | None:
        self.run.fs.invalidate_cache()
        return self.run.marker(name)

    def set_marker(self, name: str, payload: dict | None = None) -> None:
        self.run.set_marker(name, payload)

    def stop_requested(self, attempt: int | None = None) -> bool:
        """Whether the run is stopped, for a task of `attempt` (a stale stop of an earlier attempt
        does not count; see `RunDir.stop_marker`)."""
        self.run.fs.invalidate_cache()
        return self.run.stop_requested(attempt)

    def phase_done(self, phase: int) -> dict | None:
        """The marker of the checkpoint closing phase `phase` ({"step", "checkpoint"}), or None."""
        return self.marker(self.run.phase_done_marker(phase))

    # replay gates (the engine's steps: pipeline.orchestration) ----------------------------------
    def replay_gate_min_groups(self) -> int:
        from pipeline.orchestration import replay_gate_min_groups

        return replay_gate_min_groups(self.run.config())

    def replay_gate(self, epoch: int, min_groups: int | None = None) -> dict:
        """Where replay gate `epoch` stands (reads only): see `orchestration.check_replay_gate`."""
        from pipeline.orchestration import check_replay_gate

        self.run.fs.invalidate_cache()
        return check_replay_gate(self.run, epoch, min_groups)

    def poll_replay_gate(self, epoch: int) -> dict:
        """Look at replay gate `epoch` and open it if it is ready: `orchestration.poll_replay_gate`."""
        from pipeline.orchestration import poll_replay_gate

        self.run.fs.invalidate_cache()
        return poll_replay_gate(self.run, epoch)

    def open_replay_gate(self, epoch: int, eligible: int | None) -> dict:
        from pipeline.orchestration import open_replay_gate

        self.run.fs.invalidate_cache()
        return open_replay_gate(self.run, epoch, eligible)

    def replay_epoch_skipped(self, epoch: int) -> bool:
        """True when the trainer finished without replay epoch `epoch` (too few eligible groups)."""
        from pipeline.orchestration import replay_epoch_skipped

        self.run.fs.invalidate_cache()
        return replay_epoch_skipped(self.run, epoch)

    def request_stop(self, reason: str) -> None:
        if not self.run.stop_requested():
            self.run.request_stop(reason)

    # buffer ----------------------------------------------------------------------------------
    def buffer(self, cfg=None):
        from pipeline.buffer import ReplayBuffer

        return ReplayBuffer(self.run.buffer_url, (cfg or self.run.config()).buffer)

    def buffer_stats(self, buffer=None) -> dict | None:
        try:
            return (buffer or self.buffer()).stats()
        except FileNotFoundError:
            return None

    # dashboard -------------------------------------------------------------------------------
    def curves(self, stream: str, records: list[dict]) -> dict[str, list[list[float]]]:
        """{metric: [[x, value], ...]} for the plotted keys of one metrics stream (its `records`)."""
        kind = "sampler" if stream.startswith("sampler") else stream
        if kind not in CURVES:
            return {}
        x_key, y_keys = CURVES[kind]
        records = [r for r in records if isinstance(r.get(x_key), (int, float))]
        out: dict[str, list[list[float]]] = {}
        for key in y_keys:
            pts = [[r[x_key], r[key]] for r in records if isinstance(r.get(key), (int, float))]
            if pts:
                out[key] = _downsample(pts)
        return out

    def streams(self) -> list[str]:
        return self.run.metric_streams()

    def eval_curve(self) -> dict[str, list[list[float]]]:
        """Held-out score and accuracy per evaluated policy version (eval.json of finalize)."""
        evals = self.run.read_json("eval.json") or {}
        out: dict[str, list[list[float]]] = {}
        for version in sorted(evals, key=int):
            for key in ("score", "acc"):
                value = evals[version].get(key) if isinstance(evals[version], dict) else None
                if isinstance(value, (int, float)):
                    out.setdefault(f"eval/{key}", []).append([int(version), value])
        return out

    def phases(self, cfg=None) -> list[dict]:
        cfg = cfg or self.run.config()
        n_phases = int(getattr(cfg.trainer, "phases", 1) or 1)
        n_epochs = int(getattr(cfg.trainer, "replay_epochs", 0) or 0)
        names = set(self.run.markers())
        out = []
        for k in range(n_phases):
            name = self.run.phase_done_marker(k)
            m = self.run.marker(name) if name in names else None
            out.append({"kind": "phase", "index": k, "done": m is not None,
                        "step": (m or {}).get("step"), "checkpoint": (m or {}).get("checkpoint")})
        for e in range(n_epochs):
            name = self.run.replay_gate_marker(e)
            m = self.run.marker(name) if name in names else None
            out.append({"kind": "replay_gate", "index": e, "done": m is not None,
                        "eligible": (m or {}).get("eligible")})
        return out

    def charts(self, phases: list[dict], versions: list[int], latest: int | None,
               metrics: dict[str, list[dict]], cfg=None, buffer=None) -> dict:
        """The dashboard's chart data (`plugins.dashboard.series`): streams as columns over step
        and wall time, staleness histogram, activity and overlap, phase and gate events, buffer
        tiers over time, a compact summary of the policy versions. `metrics`: {stream: records};
        `cfg`, `buffer`: the run's config and buffer, when the caller has them."""
        from plugins.dashboard import series

        run = self.run
        cfg = cfg or run.config()
        trainer = metrics.get("trainer", [])
        samplers = {name: recs for name, recs in metrics.items() if name.startswith("sampler")}
        history = series.BufferHistory.of(run.buffer_url)
        try:
            history.update((buffer or self.buffer(cfg)).log)
        except FileNotFoundError:
            pass
        return {
            "streams": {"trainer": series.table(trainer, "step", series.TRAINER_KEYS),
                        **{name: series.table(recs, "sampler/batch", series.SAMPLER_KEYS) for name, recs in samplers.items()}},
            "staleness_hist": series.staleness_histogram(trainer),
            "activity": series.activity(trainer, list(samplers.values())),
            "events": series.events(run, phases, trainer),
            "buffer_history": history.series(),
            "versions": series.version_summary(versions, latest, cfg.trainer.sync_every, list(samplers.values())),
        }

    def status(self) -> dict:
        """Everything the dashboard shows, as one JSON-ready dict."""
        from pipeline.policy import PolicyStore

        from pipeline.metrics import StreamReader

        run = self.run
        cfg = run.config()  # once a poll: parsing it was a third of a poll's time
        policy = PolicyStore(run)
        latest = policy.latest()
        versions = policy.versions()
        phases = self.phases(cfg)
        created = (run.read_json("prepare.json") or {}).get("created")
        readers = _Readers.of(f"{run.url}#{created}")
        with readers.lock:
            metrics = {name: readers.streams.setdefault(name, StreamReader(run, name)).read() for name in self.streams()}
            if readers.buffer is None:
                readers.buffer = self.buffer(cfg)
            buffer, buffer_stats = readers.buffer, self.buffer_stats(readers.buffer)
        return {
            "run_id": run.run_id,
            "run_url": run.url,
            "config": {
                "model": cfg.model.path, "dataset": cfg.data.train, "reward": cfg.reward.fn,
                "algorithm": cfg.trainer.algorithm, "steps": cfg.trainer.steps,
                "phases": getattr(cfg.trainer, "phases", None),
                "replay_epochs": getattr(cfg.trainer, "replay_epochs", None),
                "sampler_backend": cfg.sampler.backend,
            },
            "markers": sorted(run.markers()),
            "stopped": run.stop_requested(),
            "trainer_done": run.has_marker(run.TRAINER_DONE_MARKER),
            "phases": phases,
            "policy": {"latest": latest, "versions": versions,
                       "manifest": policy.manifest(latest) if latest is not None else None},
            "buffer": buffer_stats,
            "curves": {**{name: self.curves(name, recs) for name, recs in metrics.items()}, "eval": self.eval_curve()},
            "summary": run.read_json("summary.json"),
            "charts": self.charts(phases, versions, latest, metrics, cfg, buffer),
        }
