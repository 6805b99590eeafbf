"""docker/compose.yaml would come up: checked by reading it (no Docker daemon on these machines).

Every long-running service has a healthcheck, an init process and a restart policy; one-shot
services are waited for; the volumes the uid-50000 image writes are handed to that uid before
anything starts; one worker per GPU, each reserving its own device; the UI password file is
written in the container that reads it; a models volume; secrets stay out of git and out of the
engine's processes."""

import os
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
IMAGE_UID = "50000"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def one_shot(svc: dict) -> bool:
    return str(svc.get("restart")) == "no"


def ours(svc: dict) -> bool:
    return str(svc.get("image", "")).startswith("rlhf-pipeline")


def needs(services: dict, name: str) -> set[str]:
    """Every service `name` waits for, directly or not."""
    seen, todo = set(), [name]
    while todo:
        for dep in services[todo.pop()].get("depends_on") or {}:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def command_text(svc: dict) -> str:
    cmd = svc.get("command") or []
    return " ".join(cmd) if isinstance(cmd, list) else str(cmd)


def test_every_long_running_service_has_a_healthcheck_an_init_and_a_restart_policy(services):
    for name, svc in services.items():
        assert svc.get("init") is True, name
        assert svc.get("restart") in ("always", "unless-stopped", "no"), name
        if one_shot(svc):
            continue
        test = (svc.get("healthcheck") or {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name


def test_one_shot_services_are_waited_for_until_they_succeed(services):
    for name, svc in services.items():
        if not one_shot(svc):
            continue
        waiting = [n for n, s in services.items() if (s.get("depends_on") or {}).get(name)]
        assert waiting, f"nobody waits for {name}"
        for other in waiting:
            assert services[other]["depends_on"][name]["condition"] == "service_completed_successfully"


def test_components_are_checked_the_way_the_official_compose_file_checks_them(services):
    checks = {name: " ".join(svc["healthcheck"]["test"]) for name, svc in services.items() if "healthcheck" in svc}
    assert "DagProcessorJob" in checks["dag-processor"] and "TriggererJob" in checks["triggerer"]
    assert "8974/health" in checks["scheduler"]
    assert services["scheduler"]["environment"]["AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK"] == "true"
    workers = {n: s for n, s in services.items() if "celery" in command_text(s) and "worker" in command_text(s)}
    assert len(workers) >= 2
    for name, svc in workers.items():
        node = re.search(r"--celery-hostname (\S+)@%h", command_text(svc)).group(1)
        assert f'inspect ping -d "{node}@$${{HOSTNAME}}"' in checks[name], name
    assert len({re.search(r"--celery-hostname (\S+)", command_text(s)).group(1) for s in workers.values()}) == len(workers)


def test_one_worker_per_gpu_each_reserving_its_own_device(services):
    gpu = {n: s for n, s in services.items() if s.get("deploy")}
    assert len(gpu) >= 2
    ids = []
    for name, svc in gpu.items():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device, f"{name} reserves every GPU"
        assert len(device["device_ids"]) == 1, name
        ids += device["device_ids"]
        cmd = command_text(svc)
        assert "--concurrency 1" in cmd and f"--queues {svc['environment']['RLHF_DEVICE_QUEUE']}" in cmd, name
        assert svc["environment"]["RLHF_DEDICATED_DEVICES"] == "1", name
    assert len(set(ids)) == len(ids)
    # the pool has one slot per GPU worker; a run's trainer holds the slots of its sampler's and its own
    assert int(services["airflow-init"]["environment"]["RLHF_GPUS"]) == len(gpu)
    assert int(services["scheduler"]["environment"]["RLHF_RUN_DEVICE_SLOTS"]) == 2 <= len(gpu)


def test_volumes_the_image_writes_are_handed_to_its_uid_before_anything_starts(compose, services):
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert re.search(rf"^USER {IMAGE_UID}(:0)?$", dockerfile, re.M)
    owners = [n for n, s in services.items() if one_shot(s) and str(s.get("user", "")).startswith("0")]
    assert owners, "no one-shot root service hands the volumes over"
    chowned = " ".join(command_text(services[n]) for n in owners)
    assert f"chown -h {IMAGE_UID}:0" in chowned and f"chown {IMAGE_UID}:0" in chowned
    for name, svc in services.items():
        if not ours(svc) or name in owners:
            continue
        assert set(owners) <= needs(services, name), f"{name} may start before the volumes are handed over"
        for mount in svc.get("volumes", []):
            volume, path = mount.split(":")[:2]
            assert volume in compose["volumes"], mount
            assert path in chowned, f"{path} ({name}) is not handed to uid {IMAGE_UID}"
            assert path in dockerfile, f"{path} is not created in the image"


def test_a_models_volume_is_mounted_read_only_on_the_gpu_workers(compose, services):
    assert "models" in compose["volumes"]
    for name, svc in services.items():
        if svc.get("deploy"):
            assert "models:/data/models:ro" in svc["volumes"], name
    assert "/data/models" in (DOCKER / "compose.yaml").read_text().split("services:")[0]  # how to fill it


def test_the_ui_password_file_is_written_by_the_api_server_that_reads_it(services):
    api = services["api-server"]
    path = api["environment"]["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]
    assert f"> {path}" in command_text(api) and "exec airflow api-server" in command_text(api)
    assert path not in command_text(services["airflow-init"])


def test_secrets_stay_out_of_git_the_image_and_the_engine_processes(services):
    for ignore in (REPO / ".gitignore", DOCKER / "Dockerfile.dockerignore"):
        assert {"docker/secrets.env", "docker/postgres.env"} <= set(ignore.read_text().split()), ignore
    for name, svc in services.items():
        assert svc.get("env_file") in (None, ["secrets.env"] if ours(svc) else ["postgres.env"]), name
    postgres = [line.split("=", 1)[0] for line in (DOCKER / "postgres.env.example").read_text().splitlines()
                if line and not line.startswith("#")]
    assert postgres == ["POSTGRES_PASSWORD"]
    from plugins.operators.process import engine_environment

    example = [line.split("=", 1)[0] for line in (DOCKER / "secrets.env.example").read_text().splitlines()
               if line and not line.startswith("#")]
    assert len(example) >= 6
    passed = engine_environment(dict.fromkeys(example, "secret-value"))
    assert not set(example) & set(passed), set(example) & set(passed)
    # storage credentials are the exception: the engine reads and writes the run directory
    assert "AWS_SECRET_ACCESS_KEY" in engine_environment({"AWS_SECRET_ACCESS_KEY": "x"})


def test_the_entrypoint_runs_the_commands_of_compose_and_of_the_helm_chart(tmp_path, services):
    import subprocess

    stub = tmp_path / "airflow"
    stub.write_text('#!/bin/sh\necho "airflow $*"\n')
    stub.chmod(0o755)

    def run(*args: str) -> str:
        out = subprocess.run(["bash", str(DOCKER / "entrypoint"), *args], env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=10)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run() == "airflow version"
    # compose: the Airflow subcommand alone (a `celery` executable is on PATH too)
    for name in ("scheduler", "worker-gpu0"):
        assert run(*services[name]["command"]) == "airflow " + " ".join(services[name]["command"])
    # the Helm chart: its containers' args and probes, the KubernetesExecutor's task pods
    assert run("bash", "-c", "exec airflow scheduler") == "airflow scheduler"
    assert run("airflow", "db", "check-migrations", "--migration-wait-timeout=60") == \
        "airflow db check-migrations --migration-wait-timeout=60"
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "/entrypoint"]' in dockerfile and " tini " in dockerfile
    assert "/clean-logs" in dockerfile  # the log groomer's


def test_the_image_installs_its_dependencies_before_it_copies_the_code():
    """A change to the code, a DAG, a config or the README must not invalidate the layer that
    installs torch and Airflow: only pyproject.toml and constraints.txt come before it."""
    lines = [line.strip() for line in (DOCKER / "Dockerfile").read_text().splitlines()]
    deps = next(i for i, line in enumerate(lines) if 'pip install -c constraints.txt ".[' in line)
    copied = [line.split()[1:-1] for line in lines[:deps] if line.startswith("COPY ")]
    assert copied == [["pyproject.toml", "constraints.txt"]], copied
    later = [line for line in lines[deps:] if line.startswith("COPY ")]
    for src in ("README.md", "pipeline", "plugins", "dags", "configs"):
        assert any(line.split()[1] == src for line in later), src
    assert lines.index("RUN pip install --no-deps --force-reinstall .") > max(lines.index(c) for c in later[:5])


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root (the volumes-init service runs as root)")
def test_volumes_init_hands_a_volume_over_once_and_redoes_an_interrupted_hand_over(tmp_path, services):
    import subprocess

    script = command_text(services["volumes-init"]).removeprefix("-c ").replace("$$", "$")
    folders = ["/data/runs", "/data/prompts", "/data/cache", "/data/models", "/opt/airflow/logs"]
    for f in folders:
        assert f in script
        (tmp_path / f.strip("/")).mkdir(parents=True)
        script = script.replace(f, str(tmp_path / f.strip("/")))
    runs = tmp_path / "data" / "runs"
    (runs / "r1" / "buffer").mkdir(parents=True)
    (runs / "r1" / "buffer" / "shard.parquet").write_bytes(b"x")
    os.symlink("/etc/hostname", runs / "r1" / "link")

    def hand_over():
        subprocess.run(["bash", "-c", script], check=True, timeout=30)

    def owner(p):
        st = os.lstat(p)
        return st.st_uid, st.st_gid

    hand_over()
    for p in [tmp_path / f.strip("/") for f in folders] + [runs / "r1", runs / "r1" / "buffer" / "shard.parquet"]:
        assert owner(p) == (int(IMAGE_UID), 0), p
    assert owner(runs / "r1" / "link") == (int(IMAGE_UID), 0) and owner("/etc/hostname")[0] != int(IMAGE_UID)  # not followed
    os.chown(runs / "r1" / "buffer" / "shard.parquet", 123, 123)
    hand_over()  # handed over: the folders are checked, their files not walked again
    assert owner(runs / "r1" / "buffer" / "shard.parquet") == (123, 123)
    os.chown(runs, 0, 0)  # an interrupted hand-over leaves the top folder to last
    hand_over()
    assert owner(runs / "r1" / "buffer" / "shard.parquet") == (int(IMAGE_UID), 0)
