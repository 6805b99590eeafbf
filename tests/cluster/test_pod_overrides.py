"""The Kubernetes pods of the device tasks (plugins/pod_override.py), checked against the
Kubernetes API models of the `kubernetes` client: built as V1Pod, serialized as the API server
would receive them, deserialized back; no cluster needed."""

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from plugins.pod_override import PodSettings, device_pod, device_task_kwargs, pods_wanted

k8s = pytest.importorskip("kubernetes.client", reason="the `cluster` extra (make test-cluster) installs it")

REPO = Path(__file__).resolve().parents[2]
K8S_ENV = {
    "AIRFLOW__CORE__EXECUTOR": "KubernetesExecutor",
    "RLHF_POD_IMAGE": "registry.example.com/rlhf-pipeline:1.0",
    "RLHF_POD_GPUS": "1", "RLHF_POD_TRAINER_GPUS": "4",
    "RLHF_POD_CPU": "8", "RLHF_POD_MEMORY": "64Gi",
    "RLHF_POD_NODE_SELECTOR": "cloud.google.com/gke-accelerator=nvidia-h100-80gb,pool=gpu",
    "RLHF_POD_STORAGE_SECRET": "rlhf-storage",
    "RLHF_POD_MODELS_CLAIM": "rlhf-models",
    "RLHF_RUNS_ROOT": "s3://team-bucket/runs",
    "AWS_DEFAULT_REGION": "eu-west-1",
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "do-not-copy-me",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://secret@db/airflow",
}


def round_trip(pod):
    """The pod as JSON for the API server, then parsed back into the API model."""
    api = k8s.ApiClient()
    body = api.sanitize_for_serialization(pod)
    text = json.dumps(body)
    back = api.deserialize(SimpleNamespace(data=text), "V1Pod")  # as from the API server's response
    assert api.sanitize_for_serialization(back) == body
    return body, back


def test_no_pod_and_no_kubernetes_import_on_other_executors():
    code = ("import sys; from plugins.pod_override import device_task_kwargs; "
            "assert device_task_kwargs('trainer', {'AIRFLOW__CORE__EXECUTOR': 'CeleryExecutor'}) == {}; "
            "assert device_task_kwargs('trainer', {'AIRFLOW__CORE__EXECUTOR': 'LocalExecutor'}) == {}; "
            "print('kubernetes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_override_is_built_for_kubernetes_or_when_asked_and_never_when_refused():
    assert pods_wanted({"AIRFLOW__CORE__EXECUTOR": "KubernetesExecutor"})
    assert pods_wanted({"AIRFLOW__CORE__EXECUTOR": "CeleryExecutor", "RLHF_POD_OVERRIDE": "1"})
    assert not pods_wanted({"AIRFLOW__CORE__EXECUTOR": "KubernetesExecutor", "RLHF_POD_OVERRIDE": "0"})
    assert not pods_wanted({"AIRFLOW__CORE__EXECUTOR": "CeleryExecutor"})
    multi = device_task_kwargs("sampler", {"AIRFLOW__CORE__EXECUTOR": "CeleryExecutor,KubernetesExecutor"})
    assert multi["executor"] == "KubernetesExecutor" and "pod_override" in multi["executor_config"]
    only = device_task_kwargs("sampler", {"AIRFLOW__CORE__EXECUTOR": "KubernetesExecutor"})
    assert "executor" not in only  # the default executor already


@pytest.mark.parametrize("role, gpus", [("sampler", "1"), ("trainer", "4"), ("finalize", "1")])
def test_device_pod_round_trips_through_the_api_model_with_gpus_nodes_and_storage(role, gpus):
    pod = device_task_kwargs(role, K8S_ENV)["executor_config"]["pod_override"]
    assert isinstance(pod, k8s.V1Pod)
    body, back = round_trip(pod)
    container = back.spec.containers[0]
    assert container.name == "base"  # the container KubernetesExecutor merges the override into
    assert container.image == K8S_ENV["RLHF_POD_IMAGE"]
    assert container.resources.limits == {"nvidia.com/gpu": gpus, "cpu": "8", "memory": "64Gi"}
    assert container.resources.requests == container.resources.limits
    assert back.spec.node_selector == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "pool": "gpu"}
    assert [(t.key, t.operator, t.effect) for t in back.spec.tolerations] == [("nvidia.com/gpu", "Exists", "NoSchedule")]
    env = {e.name: e.value for e in container.env}
    assert env["RLHF_RUNS_ROOT"] == "s3://team-bucket/runs" and env["AWS_DEFAULT_REGION"] == "eu-west-1"
    assert env["RLHF_DEDICATED_DEVICES"] == "1"
    assert [s.secret_ref.name for s in container.env_from] == ["rlhf-storage"]  # credentials by reference
    text = json.dumps(body)
    assert "do-not-copy-me" not in text and "AKIAEXAMPLE" not in text and "SQL_ALCHEMY" not in text
    mounts = {m.name: (m.mount_path, m.read_only) for m in container.volume_mounts}
    claims = {v.name: v.persistent_volume_claim.claim_name for v in back.spec.volumes}
    assert mounts == {"models": ("/data/models", True)} and claims == {"models": "rlhf-models"}
    # required fields of the API model are there: a container has a name, a toleration an operator
    assert all(c["name"] for c in body["spec"]["containers"])


def test_a_runs_root_on_a_shared_volume_is_mounted_from_its_claim_and_cpu_pods_get_no_gpu_toleration():
    env = {"RLHF_RUNS_ROOT": "/data/runs", "RLHF_POD_RUNS_CLAIM": "rlhf-runs", "RLHF_POD_GPUS": "0",
           "RLHF_POD_TOLERATIONS": json.dumps([{"key": "team", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}])}
    _, back = round_trip(device_pod("trainer", PodSettings.from_env(env)))
    container = back.spec.containers[0]
    assert container.resources.limits is None
    assert [(m.name, m.mount_path) for m in container.volume_mounts] == [("runs", "/data/runs")]
    assert back.spec.volumes[0].persistent_volume_claim.claim_name == "rlhf-runs"
    assert [(t.key, t.value) for t in back.spec.tolerations] == [("team", "rl")]
    _, cpu = round_trip(device_pod("trainer", PodSettings.from_env({"RLHF_POD_GPUS": "0"})))
    assert cpu.spec.tolerations is None


@pytest.mark.parametrize("env, field", [({"RLHF_POD_NODE_SELECTOR": "gpu"}, "RLHF_POD_NODE_SELECTOR"),
                                        ({"RLHF_POD_TOLERATIONS": '{"key": "x"}'}, "RLHF_POD_TOLERATIONS"),
                                        ({"RLHF_POD_GPUS": "-1"}, "GPUS")])
def test_bad_settings_fail_naming_the_variable(env, field):
    with pytest.raises(ValueError, match=field):
        PodSettings.from_env(env)


def test_the_rlhf_train_dag_gives_its_device_tasks_the_pod_when_parsed_for_kubernetes(tmp_path):
    """Parsed as a KubernetesExecutor deployment's dag-processor would: the sampler, trainer and
    finalize carry the override; prepare and the sensors do not."""
    code = ("import json, importlib.util; from kubernetes.client import ApiClient\n"
            "spec = importlib.util.spec_from_file_location('d', 'dags/rlhf_train.py')\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "out = {t.task_id: ApiClient().sanitize_for_serialization((t.executor_config or {}).get('pod_override'))"
            " for t in m.dag.tasks}\n"
            "print(json.dumps(out))")
    env = {**K8S_ENV, "PATH": "/usr/bin:/bin", "AIRFLOW_HOME": str(tmp_path),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__UNIT_TEST_MODE": "True"}
    env.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    pods = json.loads(out.stdout.strip().splitlines()[-1])
    for task_id in ("sampler", "trainer", "finalize"):
        assert pods[task_id]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"], task_id
    assert pods["trainer"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert pods["prepare"] is None and pods["stop_sampler"] is None


def test_the_helm_values_set_the_kubernetes_executor_and_pod_settings_that_build_valid_pods():
    import yaml

    import plugins.pod_override as pod_override

    values = yaml.safe_load((REPO / "docker" / "helm-values.yaml").read_text())
    env = {e["name"]: str(e["value"]) for e in values["env"]}
    env["AIRFLOW__CORE__EXECUTOR"] = values["executor"]
    assert values["executor"] == "KubernetesExecutor"
    assert values["images"]["airflow"]["repository"] and values["uid"] == 50000
    for key in ("metadataSecretName",):
        assert values["data"][key]
    assert values["jwtSecretName"] and values["apiSecretKeySecretName"] and values["fernetKeySecretName"]
    unknown = [n for n in env if n.startswith("RLHF_POD_") and n not in pod_override.__doc__]
    assert not unknown, unknown
    # a run's trainer holds the slots of the run's GPUs (its own and one sampler's), within the pool
    slots = int(env["RLHF_RUN_DEVICE_SLOTS"])
    assert slots == int(env["RLHF_POD_TRAINER_GPUS"]) + int(env["RLHF_POD_GPUS"])
    text = (REPO / "docker" / "helm-values.yaml").read_text()
    assert slots <= int(re.search(r"pools set rlhf_devices (\d+)", text).group(1))
    for role in ("sampler", "trainer", "finalize"):
        body, back = round_trip(device_task_kwargs(role, env)["executor_config"]["pod_override"])
        assert back.spec.containers[0].resources.limits["nvidia.com/gpu"] == env.get(
            f"RLHF_POD_{role.upper()}_GPUS", env["RLHF_POD_GPUS"])
        assert back.spec.containers[0].env_from[0].secret_ref.name == env["RLHF_POD_STORAGE_SECRET"]
