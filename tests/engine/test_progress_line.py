"""The progress line a person reads, built from a run directory (the same function for `rlhf run`,
`rlhf airflow demo` and the trainer's task log), and the trainer watch's stall detection."""

import pytest

from pipeline.config import parse_config
from pipeline.progress import TrainerWatch, format_duration, format_rate, progress_line
from pipeline.rundir import RunDir


@pytest.fixture
def run(tmp_path):
    run = RunDir(f"file://{tmp_path}/r")
    run.create(parse_config({"trainer": {"steps": 400, "phases": 2, "replay_epochs": 1, "groups_per_step": 4},
                             "sampler": {"prompts_per_batch": 4}}))
    return run


def log_steps(run, steps, t0=1000.0, dt=0.5):
    log = run.metrics("trainer")
    for s in steps:
        log.log({"time": t0 + s * dt, "step": s, "reward/mean": 0.56, "perf/tokens_per_s": 1900.0,
                 "staleness/mean": 1.2})
    log.flush()


def test_the_line_names_step_reward_heldout_throughput_staleness_eta_phase_and_gate(run):
    log_steps(run, range(101, 121))
    run.write_json("eval.json", {"0": {"score": 0.43}, "120": {"score": 0.61}})
    assert progress_line(run) == ("step 120/400 · reward 0.56 · held-out 0.61 · 1.9k tok/s · staleness 1.2 · "
                                  "ETA 2m20s · phase 1/2 · replay gates 0/1 open")
    run.set_marker(RunDir.phase_done_marker(0), {"step": 200})
    run.set_marker(RunDir.replay_gate_marker(0), {"eligible": 8})
    assert progress_line(run).endswith("phase 2/2 · replay gate 0 open")


def test_before_the_first_step_the_line_says_so(run):
    assert progress_line(run) == "waiting for the first trainer step (of 400) · phase 1/2 · replay gates 0/1 open"


def test_number_formats():
    assert [format_duration(s) for s in (5, 70, 3700)] == ["5s", "1m10s", "1h01m"]
    assert [format_rate(r) for r in (250, 1900, 2.5e6)] == ["250", "1.9k", "2.5M"]


def test_watch_logs_every_n_steps_and_reports_a_stall_after_the_timeout(run):
    now = [0.0]
    watch = TrainerWatch(run, every=5, stall_timeout_s=30, clock=lambda: now[0])
    assert watch.poll() == (None, None)  # no step yet: the clock starts
    log_steps(run, range(1, 6))
    now[0] = 20.0
    line, stalled = watch.poll()
    assert line.startswith("step 5/400") and stalled is None
    now[0] = 45.0  # 25 s after the last new step
    assert watch.poll() == (None, None)
    now[0] = 51.0
    line, stalled = watch.poll()
    assert line is None and "no new trainer step for 31s" in stalled and "last step 5" in stalled
    log_steps(run, [6])
    assert watch.poll()[1] is None  # a new step resets the clock


def test_a_finished_trainer_never_counts_as_stalled(run):
    now = [0.0]
    watch = TrainerWatch(run, every=5, stall_timeout_s=10, clock=lambda: now[0])
    watch.poll()
    run.set_marker(run.TRAINER_DONE_MARKER, {"step": 400})
    now[0] = 100.0
    assert watch.poll()[1] is None


def test_the_watch_follows_a_stream_a_resumed_trainer_replaced(run):
    """A resumed trainer drops the steps it redoes: the watch's last step is the new stream's."""
    now = [0.0]
    watch = TrainerWatch(run, every=5, stall_timeout_s=10, clock=lambda: now[0])
    log_steps(run, range(1, 11))
    watch.poll()
    run.metrics("trainer").replace([r for r in run.read_metrics("trainer") if r["step"] <= 4])
    now[0] = 1.0
    watch.poll()
    for t, step in ((8.0, 5), (16.0, 6), (24.0, 7)):  # the steps it redoes, each within the timeout
        log_steps(run, [step])
        now[0] = t
        assert watch.poll()[1] is None, step
    now[0] = 35.0
    assert "last step 7" in watch.poll()[1]
