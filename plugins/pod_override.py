"""Kubernetes pods for the device-heavy tasks (sampler, trainer, finalize).

On the KubernetesExecutor (or where a multi-executor deployment lists it: the device tasks then
name it as their executor) each device task runs in a pod of its own, and its `executor_config`
carries a pod override (`{"pod_override": V1Pod}`) merged into the deployment's pod template:
the image, the GPUs it needs as a resource limit (`nvidia.com/gpu`), node selector and
tolerations for the GPU nodes, and the run storage. The settings come from the environment of the
component that parses the DAG files (the dag-processor; docker/helm-values.yaml sets them):

    RLHF_POD_IMAGE              image of the task's container (default: the pod template's)
    RLHF_POD_GPUS               GPUs per device task (default 1); per role: RLHF_POD_SAMPLER_GPUS,
                                RLHF_POD_TRAINER_GPUS, RLHF_POD_FINALIZE_GPUS
    RLHF_POD_GPU_RESOURCE       the resource name (default nvidia.com/gpu)
    RLHF_POD_CPU, RLHF_POD_MEMORY   requests = limits of the container, e.g. 8 and 64Gi
    RLHF_POD_NODE_SELECTOR      JSON object, or key=value,key=value
    RLHF_POD_TOLERATIONS        JSON list of tolerations (Kubernetes field names); default with
                                GPUs: tolerate the `nvidia.com/gpu` taint
    RLHF_POD_STORAGE_SECRET     a Secret holding the storage credentials (AWS_*, ...): the pod
                                gets it with envFrom; values are never copied into the spec
    RLHF_POD_RUNS_CLAIM         a PersistentVolumeClaim mounted at RLHF_RUNS_ROOT when that is a
                                path (NFS, a shared volume) rather than an object-store URL
    RLHF_POD_MODELS_CLAIM       a claim holding models, mounted read-only at RLHF_POD_MODELS_PATH
                                (default /data/models)
    RLHF_POD_OVERRIDE           1: build the override whatever the executor (a multi-executor
                                deployment that sends device tasks elsewhere); 0: never

The pod also gets RLHF_RUNS_ROOT, RLHF_ALLOWED_STORAGE_ROOTS and the non-secret storage settings
(FSSPEC_*, AWS_DEFAULT_REGION, AWS_REGION, AWS_ENDPOINT_URL*) of that environment, and
RLHF_DEDICATED_DEVICES=1 (its GPUs are its own: `pipeline.devices`). The Kubernetes client is
imported only when an override is built; elsewhere this module costs nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

DEVICE_ROLES = ("sampler", "trainer", "finalize")
KUBERNETES_EXECUTOR = "KubernetesExecutor"
# the container KubernetesExecutor runs the task in; an override must use this name
BASE_CONTAINER = "base"
PASSED_STORAGE_NAMES = ("AWS_DEFAULT_REGION", "AWS_REGION", "RLHF_RUNS_ROOT", "RLHF_ALLOWED_STORAGE_ROOTS",
                        "RLHF_PROMPTS_ROOT", "RLHF_CONFIGS_DIR")
PASSED_STORAGE_PREFIXES = ("FSSPEC_", "AWS_ENDPOINT_URL")
GPU_TAINT = "nvidia.com/gpu"


def executors(env: Mapping[str, str] | None = None) -> list[str]:
    """The deployment's executors, the default first (`[core] executor`, a comma-separated list)."""
    env = os.environ if env is None else env
    value = env.get("AIRFLOW__CORE__EXECUTOR")
    if value is None:
        try:
            from airflow.configuration import conf

            value = conf.get("core", "executor", fallback="")
        except Exception:  # no Airflow configuration here (unit tests, tools)
            value = ""
    return [e.strip().split(".")[-1].split(":")[-1] for e in value.split(",") if e.strip()]


def pods_wanted(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    forced = env.get("RLHF_POD_OVERRIDE", "").strip().lower()
    if forced in ("0", "false", "no"):
        return False
    return forced in ("1", "true", "yes") or KUBERNETES_EXECUTOR in executors(env)


def _mapping(value: str, name: str) -> dict[str, str]:
    value = value.strip()
    if not value:
        return {}
    if value.startswith("{"):
        out = json.loads(value)
    else:
        pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"{name}: {value!r}; use JSON or key=value,key=value")
        out = {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(out, dict):
        raise ValueError(f"{name}: expected a JSON object, got {value!r}")
    return {str(k): str(v) for k, v in out.items()}


@dataclass(frozen=True)
class PodSettings:
    """What a device pod gets; `from_env` reads the RLHF_POD_* variables (module docstring)."""

    image: str | None = None
    gpus: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(DEVICE_ROLES, 1))
    gpu_resource: str = "nvidia.com/gpu"
    cpu: str | None = None
    memory: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[dict, ...] | None = None  # None: the GPU taint's when the pod has GPUs
    storage_secret: str | None = None
    runs_claim: str | None = None
    models_claim: str | None = None
    models_path: str = "/data/models"
    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PodSettings:
        env = os.environ if env is None else env
        base = int(env.get("RLHF_POD_GPUS", "1"))
        gpus = {role: int(env.get(f"RLHF_POD_{role.upper()}_GPUS", base)) for role in DEVICE_ROLES}
        if any(n < 0 for n in gpus.values()):
            raise ValueError(f"RLHF_POD_*GPUS: {gpus}; a GPU count is 0 or more")
        tolerations = env.get("RLHF_POD_TOLERATIONS", "").strip()
        parsed = json.loads(tolerations) if tolerations else None
        if parsed is not None and not (isinstance(parsed, list) and all(isinstance(t, dict) for t in parsed)):
            raise ValueError(f"RLHF_POD_TOLERATIONS: {tolerations!r}; expected a JSON list of objects")
        passed = {k: v for k, v in env.items()
                  if k in PASSED_STORAGE_NAMES or k.startswith(PASSED_STORAGE_PREFIXES)}
        return cls(image=env.get("RLHF_POD_IMAGE") or None, gpus=gpus,
                   gpu_resource=env.get("RLHF_POD_GPU_RESOURCE") or "nvidia.com/gpu",
                   cpu=env.get("RLHF_POD_CPU") or None, memory=env.get("RLHF_POD_MEMORY") or None,
                   node_selector=_mapping(env.get("RLHF_POD_NODE_SELECTOR", ""), "RLHF_POD_NODE_SELECTOR"),
                   tolerations=tuple(parsed) if parsed is not None else None,
                   storage_secret=env.get("RLHF_POD_STORAGE_SECRET") or None,
                   runs_claim=env.get("RLHF_POD_RUNS_CLAIM") or None,
                   models_claim=env.get("RLHF_POD_MODELS_CLAIM") or None,
                   models_path=env.get("RLHF_POD_MODELS_PATH") or "/data/models", env=passed)


def _resources(k8s, settings: PodSettings, role: str):
    limits: dict[str, str] = {}
    if settings.gpus.get(role, 0):
        limits[settings.gpu_resource] = str(settings.gpus[role])
    if settings.cpu:
        limits["cpu"] = settings.cpu
    if settings.memory:
        limits["memory"] = settings.memory
    # GPUs cannot be overcommitted: Kubernetes wants requests equal to limits for them
    return k8s.V1ResourceRequirements(limits=limits or None, requests=dict(limits) or None)


def _volumes(k8s, settings: PodSettings) -> tuple[list, list]:
    volumes, mounts = [], []
    runs_root = settings.env.get("RLHF_RUNS_ROOT", "")
    if settings.runs_claim and runs_root.startswith("/"):
        volumes.append(k8s.V1Volume(name="runs", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
            claim_name=settings.runs_claim)))
        mounts.append(k8s.V1VolumeMount(name="runs", mount_path=runs_root))
    if settings.models_claim:
        volumes.append(k8s.V1Volume(name="models", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
            claim_name=settings.models_claim, read_only=True)))
        mounts.append(k8s.V1VolumeMount(name="models", mount_path=settings.models_path, read_only=True))
    return volumes, mounts


def device_pod(role: str, settings: PodSettings | None = None):
    """The pod override (a `kubernetes.client.V1Pod`) of the device task `role`."""
    if role not in DEVICE_ROLES:
        raise ValueError(f"role {role!r}: choose one of {', '.join(DEVICE_ROLES)}")
    from kubernetes import client as k8s

    settings = settings or PodSettings.from_env()
    env = [k8s.V1EnvVar(name=k, value=str(v)) for k, v in sorted(settings.env.items())]
    env.append(k8s.V1EnvVar(name="RLHF_DEDICATED_DEVICES", value="1"))
    env_from = ([k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=settings.storage_secret))]
                if settings.storage_secret else None)
    volumes, mounts = _volumes(k8s, settings)
    container = k8s.V1Container(name=BASE_CONTAINER, image=settings.image, env=env, env_from=env_from,
                                resources=_resources(k8s, settings, role), volume_mounts=mounts or None)
    tolerations = settings.tolerations
    if tolerations is None:
        tolerations = ({"key": GPU_TAINT, "operator": "Exists", "effect": "NoSchedule"},) if settings.gpus.get(role) else ()
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(labels={"rlhf-pipeline/role": role}),
        spec=k8s.V1PodSpec(containers=[container], node_selector=dict(settings.node_selector) or None,
                           tolerations=[k8s.V1Toleration(**t) for t in tolerations] or None,
                           volumes=volumes or None))


def device_task_kwargs(role: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Operator arguments that send the device task `role` to a pod of its own: empty unless the
    deployment runs the KubernetesExecutor or RLHF_POD_OVERRIDE=1 (the client is imported then only)."""
    env = os.environ if env is None else env
    if not pods_wanted(env):
        return {}
    out: dict[str, Any] = {"executor_config": {"pod_override": device_pod(role, PodSettings.from_env(env))}}
    names = executors(env)
    if KUBERNETES_EXECUTOR in names and names[0] != KUBERNETES_EXECUTOR:
        out["executor"] = KUBERNETES_EXECUTOR  # a multi-executor deployment: the device tasks go to pods
    return out
