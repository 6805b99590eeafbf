"""Scale-out settings: the multi-node trainer's rendezvous endpoint, and resuming a run at another scale."""

import threading
import time

import pytest

from pipeline import rendezvous
from pipeline.config import TrainerConfig
from pipeline.rundir import RunDir


@pytest.fixture
def run(tmp_path):
    return RunDir(f"file://{tmp_path / 'run'}")


def test_other_nodes_get_the_endpoint_node_0_publishes(run, monkeypatch):
    monkeypatch.setenv(rendezvous.ADDRESS_ENV, "127.0.0.1")
    cfg = TrainerConfig(nnodes=2, wait_timeout_s=10)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(ep=rendezvous.endpoint(run, cfg, 1)))
    waiter.start()
    time.sleep(0.3)
    published = rendezvous.endpoint(run, cfg, 0)
    waiter.join(timeout=10)
    host, port = published.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert got["ep"] == published


def test_an_endpoint_older_than_node_0s_current_try_is_not_used(run, monkeypatch):
    monkeypatch.setenv(rendezvous.ADDRESS_ENV, "127.0.0.1")
    rendezvous.publish(run)  # a dead try of node 0
    with pytest.raises(TimeoutError):
        rendezvous.wait_for(run, timeout_s=0.5, poll_s=0.1, not_before=time.time() + 1)


def test_a_configured_endpoint_is_used_as_it_is(run):
    cfg = TrainerConfig(nnodes=3, rendezvous="trainer-0.cluster:29400")
    assert rendezvous.endpoint(run, cfg, 0) == rendezvous.endpoint(run, cfg, 2) == "trainer-0.cluster:29400"
    assert not run.has_marker(RunDir.TRAINER_RENDEZVOUS_MARKER)


def test_a_run_resumes_at_another_scale_but_not_with_other_learning_settings(run):
    from pipeline.config import ConfigError, parse_config

    base = {"model": {"path": "builtin:digit"}, "data": {"train": "builtin:digit", "eval": "builtin:digit"},
            "reward": {"fn": "digit"}}
    assert run.create(parse_config(base)) is True
    scaled = parse_config({**base, "sampler": {"replicas": 4}, "trainer": {"nnodes": 2}})
    assert run.create(scaled) is False  # the same run, now spread wider
    assert run.config().sampler.replicas == 4 and run.config().trainer.nnodes == 2
    with pytest.raises(ConfigError, match="different config"):
        run.create(parse_config({**base, "trainer": {"lr": 0.5}}))
