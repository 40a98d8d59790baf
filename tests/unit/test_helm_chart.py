"""The Helm chart (deploy/helm/epd-pipeline): linted and rendered by the real, pinned helm,
and every rendered object validated against Kubernetes' and KEDA's own schemas.

The tools come from ``tools/install-tools.sh helm k8s-schemas`` (``.ci/run`` runs it before
``make test``). Without them these tests skip with that command as the reason; under
``CI=true`` they fail instead, so CI never passes on a chart it did not render.

What ties the chart to the code: the ScaledObjects' consumer groups and topics are those of
``schemas/topics.py``, the worker Deployments are the stages ``epd worker`` takes
(``epd.stages.KINDS``), the ConfigMap's keys are ``runtime.settings.Settings`` fields that
parse, and the secret's length floor is ``MIN_SECRET_CHARS``.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epd.stages import KINDS
from runtime.settings import MIN_SECRET_CHARS, Settings
from schemas.topics import Topics
from tests.helm_schemas import (
    TOOLS,
    ManifestValidator,
    default_validator,
    load_manifests,
    pinned,
)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "epd-pipeline"
HELM = TOOLS / "bin" / "helm"
RELEASE = "rel"
INSTALL = "tools/install-tools.sh helm k8s-schemas"
GPU_STAGES = ("encode", "prefill", "decode")

Objects = list[dict[str, Any]]


def _missing(what: str) -> None:
    """Skip for a missing tool, except in CI, where the tools are part of the run."""
    message = f"{what}: not installed (run {INSTALL})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must have {what} (.ci/run runs {INSTALL})")
    pytest.skip(message)


@pytest.fixture(scope="module")
def helm() -> Path:
    if not os.access(HELM, os.X_OK):
        _missing("helm")
    version = subprocess.run(
        [str(HELM), "version", "--template", "{{.Version}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # A `go install` build says only major.minor; the script checks the patch (go version -m).
    assert pinned("HELM_VERSION").startswith(version), (version, pinned("HELM_VERSION"))
    return HELM


@pytest.fixture(scope="module")
def validator() -> ManifestValidator:
    try:
        return default_validator()
    except FileNotFoundError:
        _missing("the Kubernetes and KEDA schemas")
        raise  # unreachable: _missing skips or fails


@pytest.fixture(scope="module")
def secret_values() -> list[str]:
    """A fresh random EC secret and API token per run: the chart has no defaults for them."""
    token = secrets.token_hex(16)
    return [
        f"secrets.ecSecret={secrets.token_hex(32)}",
        f"secrets.apiTokens={token}=acme",
    ]


def helm_run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def render(helm: Path, *sets: str) -> Objects:
    """``helm template`` of the chart with ``--set`` values, as objects (fails on an error)."""
    args = ["template", RELEASE, str(CHART)]
    for value in sets:
        args += ["--set", value]
    done = helm_run(helm, *args)
    assert done.returncode == 0, done.stderr
    return load_manifests(done.stdout)


def render_error(helm: Path, *sets: str) -> str:
    """The error of a ``helm template`` that must fail."""
    args = ["template", RELEASE, str(CHART)]
    for value in sets:
        args += ["--set", value]
    done = helm_run(helm, *args)
    assert done.returncode != 0, f"rendered although it must not: {sets}"
    return done.stderr


def of_kind(objects: Objects, kind: str) -> dict[str, dict[str, Any]]:
    """Objects of ``kind`` by their component label (api, encode, ...)."""
    return {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o
        for o in objects
        if o["kind"] == kind
    }


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    return c


def env_of(deployment: dict[str, Any]) -> dict[str, Any]:
    """A container's env entries by name (value or valueFrom)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(deployment)["env"]}


# --- lint and the values schema ---------------------------------------------------------


def test_helm_lint_strict_passes(helm: Path, secret_values: list[str]) -> None:
    sets = [a for v in secret_values for a in ("--set", v)]
    done = helm_run(helm, "lint", "--strict", str(CHART), *sets)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("workers.encod.gpus=1", "'encod' not allowed"),
        ("workers.encode.gpus=-1", "'/workers/encode/gpus'"),
        # The chart owns the secret (and the other values it derives): refused in settings.
        ("settings.EPD_EC_SECRET=from-values", "'/settings/EPD_EC_SECRET'"),
        ("settings.kafka_bootstrap=x", "'kafka_bootstrap' not allowed"),
        ("kafka.bootstrapServers=no-port", "'/kafka/bootstrapServers'"),
        (
            "api.autoscaling.targetCPUUtilizationPercentage=150",
            "'/api/autoscaling/targetCPUUtilizationPercentage'",
        ),
    ],
)
def test_bad_values_fail_lint_and_template_naming_the_value(
    helm: Path, secret_values: list[str], value: str, named: str
) -> None:
    error = render_error(helm, *secret_values, value)
    assert "values don't meet the specifications of the schema" in error, error
    assert named in error, error
    lint = helm_run(helm, "lint", str(CHART), "--set", value)
    assert lint.returncode != 0 and named in lint.stdout + lint.stderr


# --- secrets: never a default -----------------------------------------------------------


def test_a_missing_ec_secret_fails_rendering_with_the_fix(helm: Path) -> None:
    error = render_error(helm, "secrets.apiTokens=t=acme")
    assert "secrets.ecSecret is required" in error, error
    assert "openssl rand -hex 32" in error and "secrets.existingSecret" in error


def test_a_short_ec_secret_fails_at_the_processes_floor(helm: Path) -> None:
    short = "x" * (MIN_SECRET_CHARS - 1)
    error = render_error(helm, f"secrets.ecSecret={short}", "secrets.apiTokens=t=acme")
    assert f"fewer than {MIN_SECRET_CHARS}" in error, error
    render(helm, f"secrets.ecSecret={'x' * MIN_SECRET_CHARS}", "secrets.apiTokens=t=acme")


def test_api_tokens_are_required_unless_the_api_is_open_on_purpose(helm: Path) -> None:
    ec = f"secrets.ecSecret={secrets.token_hex(32)}"
    assert "secrets.apiTokens is required" in render_error(helm, ec)
    objects = render(helm, ec, "api.allowOpen=true")
    assert "EPD_API_TOKENS" not in env_of(of_kind(objects, "Deployment")["api"])
    assert "EPD_API_TOKENS" not in of_kind(objects, "Secret")["secrets"]["data"]


def test_an_existing_secret_replaces_the_chart_made_one(helm: Path) -> None:
    objects = render(helm, "secrets.existingSecret=mine")
    assert of_kind(objects, "Secret") == {}
    deployments = of_kind(objects, "Deployment")
    for deployment in deployments.values():
        ref = env_of(deployment)["EPD_EC_SECRET"]["secretKeyRef"]
        assert ref == {"name": "mine", "key": "EPD_EC_SECRET"}
    # The API needs the tokens key of that Secret: not optional unless allowOpen.
    tokens = env_of(deployments["api"])["EPD_API_TOKENS"]["secretKeyRef"]
    assert tokens == {"name": "mine", "key": "EPD_API_TOKENS", "optional": False}


# --- what the default render holds --------------------------------------------------------


@pytest.fixture(scope="module")
def default(helm: Path, secret_values: list[str]) -> Objects:
    return render(helm, *secret_values)


def test_the_api_deployment_service_probes_and_hpa(default: Objects) -> None:
    api = of_kind(default, "Deployment")["api"]
    c = container(api)
    assert c["args"][:1] == ["api"] and "0.0.0.0" in c["args"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    # The HPA owns the count: no replicas field to fight it.
    assert "replicas" not in api["spec"]
    hpa = of_kind(default, "HorizontalPodAutoscaler")["api"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == api["metadata"]["name"]
    service = of_kind(default, "Service")["api"]
    assert service["spec"]["selector"] == api["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_one_worker_deployment_per_default_stage_with_gpus_where_asked(default: Objects) -> None:
    deployments = of_kind(default, "Deployment")
    assert set(deployments) == {"api", "router", "encode", "prefill", "results"}
    for stage in ("router", "encode", "prefill", "results"):
        c = container(deployments[stage])
        assert c["args"][:2] == ["worker", stage]
        gpu = c["resources"]["limits"].get("nvidia.com/gpu")
        assert gpu == (1 if stage in GPU_STAGES else None), stage
        assert (env_of(deployments[stage]).get("EPD_DEVICE") == "cuda") == (stage in GPU_STAGES)
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        pod = deployments[stage]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0


def test_a_pdb_per_deployment_selecting_its_pods(default: Objects) -> None:
    deployments = of_kind(default, "Deployment")
    pdbs = of_kind(default, "PodDisruptionBudget")
    assert set(pdbs) == set(deployments)
    for name, pdb in pdbs.items():
        selector = deployments[name]["spec"]["selector"]["matchLabels"]
        assert pdb["spec"]["selector"]["matchLabels"] == selector


def test_settings_are_one_configmap_of_real_settings(
    helm: Path, secret_values: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render(helm, *secret_values, "settings.EPD_MAX_IN_FLIGHT=7")
    [configmap] = of_kind(objects, "ConfigMap").values()
    data = configmap["data"]
    assert data["EPD_MAX_IN_FLIGHT"] == "7" and data["EPD_DECODE_STAGE"] == "false"
    # Every key is a setting runtime/settings.py has, and the values parse as settings.
    fields = {f"EPD_{name.upper()}" for name in Settings.model_fields}
    assert set(data) <= fields, set(data) - fields
    for key in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(key)
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.max_in_flight == 7 and settings.topic_prefix == data["EPD_TOPIC_PREFIX"]
    for deployment in of_kind(objects, "Deployment").values():
        ref = container(deployment)["envFrom"][0]["configMapRef"]["name"]
        assert ref == configmap["metadata"]["name"]
    # The topics hook runs before the ConfigMap exists: the same settings travel inline.
    job = of_kind(objects, "Job")["topics"]
    assert container_env(job) == data


def container_env(job: dict[str, Any]) -> dict[str, str]:
    [c] = job["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in c["env"]}


# --- KEDA ---------------------------------------------------------------------------------


def test_scaled_objects_scale_each_stage_on_its_groups_lag(
    helm: Path, secret_values: list[str]
) -> None:
    """The groups and topics are schemas/topics.py's, under a prefix of the values; decode on,
    every stage `epd worker` takes has its Deployment and its ScaledObject."""
    prefix = "prod7"
    objects = render(
        helm, *secret_values, f"kafka.topicPrefix={prefix}", "workers.decode.enabled=true"
    )
    topics = Topics(prefix)
    scaled = of_kind(objects, "ScaledObject")
    deployments = of_kind(objects, "Deployment")
    assert set(scaled) == set(KINDS) and set(deployments) == {"api", *KINDS}
    for stage, so in scaled.items():
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert so["spec"]["scaleTargetRef"]["name"] == deployments[stage]["metadata"]["name"]
        triggers = so["spec"]["triggers"]
        assert {t["type"] for t in triggers} == {"kafka"}
        assert {t["metadata"]["consumerGroup"] for t in triggers} == {topics.group(stage)}
        assert [t["metadata"]["topic"] for t in triggers] == topics.read_by(stage)
        assert {t["metadata"]["bootstrapServers"] for t in triggers} == {"kafka:9092"}
        assert all(int(t["metadata"]["lagThreshold"]) > 0 for t in triggers)
        # KEDA owns the count: the Deployment carries none to reset it on upgrade.
        assert "replicas" not in deployments[stage]["spec"], stage


def test_without_keda_the_deployments_keep_their_replicas(
    helm: Path, secret_values: list[str]
) -> None:
    objects = render(helm, *secret_values, "keda.enabled=false", "workers.encode.replicas=3")
    assert of_kind(objects, "ScaledObject") == {}
    deployments = of_kind(objects, "Deployment")
    assert deployments["encode"]["spec"]["replicas"] == 3
    assert deployments["router"]["spec"]["replicas"] == 1


def test_workers_serve_their_metrics_on_the_pod_address(
    helm: Path, secret_values: list[str], default: Objects
) -> None:
    for stage, deployment in of_kind(default, "Deployment").items():
        if stage == "api":
            continue
        spec = deployment["spec"]["template"]
        args = container(deployment)["args"]
        assert args[:2] == ["worker", stage]
        assert args[2:] == ["--metrics-port", "9400", "--metrics-host", "0.0.0.0"], args
        assert container(deployment)["ports"] == [
            {"name": "metrics", "containerPort": 9400, "protocol": "TCP"}
        ]
        assert spec["metadata"]["annotations"]["prometheus.io/port"] == "9400"
    off = of_kind(render(helm, *secret_values, "workers.metrics.enabled=false"), "Deployment")
    assert container(off["encode"])["args"] == ["worker", "encode"]
    assert "ports" not in container(off["encode"])


def test_readyz_waits_only_for_stages_that_always_run_a_worker(
    helm: Path, secret_values: list[str]
) -> None:
    """A stage KEDA may scale to zero is not one /readyz waits for: an API that is not ready
    gets no traffic, and without traffic no lag would ever start that stage's worker."""

    def ready_stages(*sets: str) -> str:
        [configmap] = of_kind(render(helm, *secret_values, *sets), "ConfigMap").values()
        return str(configmap["data"]["EPD_READY_STAGES"])

    assert ready_stages() == "encode,prefill,results"
    zero = ready_stages("workers.encode.keda.minReplicas=0", "workers.decode.enabled=true")
    assert zero == "prefill,results,decode"
    assert ready_stages("keda.enabled=false", "workers.prefill.replicas=0") == "encode,results"
    assert ready_stages("settings.EPD_READY_STAGES=") == ""  # the operator's word wins


def test_decode_on_and_gpus_off_render_cpu_workers(helm: Path, secret_values: list[str]) -> None:
    off = [f"workers.{s}.gpus=0" for s in GPU_STAGES]
    objects = render(helm, *secret_values, "workers.decode.enabled=true", *off)
    deployments = of_kind(objects, "Deployment")
    assert container(deployments["decode"])["args"][:2] == ["worker", "decode"]
    for stage in GPU_STAGES:
        assert "nvidia.com/gpu" not in container(deployments[stage])["resources"]["limits"]
        assert "EPD_DEVICE" not in env_of(deployments[stage])
        assert "tolerations" not in deployments[stage]["spec"]["template"]["spec"]
    [configmap] = of_kind(objects, "ConfigMap").values()
    assert configmap["data"]["EPD_DECODE_STAGE"] == "true"
    assert configmap["data"]["EPD_PIXEL_DTYPE"] == "fp32"


# --- the worker heartbeat probe, run for real --------------------------------------------


def _probe_argv(default: Objects, probe: str) -> list[str]:
    command = container(of_kind(default, "Deployment")["encode"])[probe]["exec"]["command"]
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


def test_the_heartbeat_probe_fails_on_a_stale_or_missing_file(
    default: Objects, tmp_path: Path
) -> None:
    encode = of_kind(default, "Deployment")["encode"]
    argv = _probe_argv(default, "livenessProbe")
    path = env_of(encode)["EPD_HEARTBEAT_FILE"]
    assert argv[-2] == path and float(argv[-1]) == 60
    beat = tmp_path / "heartbeat"
    local = [*argv[:-2], str(beat), argv[-1]]

    def probe() -> int:
        return subprocess.run(local, capture_output=True, timeout=30).returncode

    assert probe() != 0  # no heartbeat yet
    beat.touch()
    assert probe() == 0
    os.utime(beat, (time.time() - 61, time.time() - 61))
    assert probe() != 0
    # The startup probe is the same check, allowed the model-load time before liveness counts.
    startup = container(encode)["startupProbe"]
    assert _probe_argv(default, "startupProbe") == argv
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900


# --- schema validation ----------------------------------------------------------------------


VARIANTS = {
    "default": [],
    "keda off": ["keda.enabled=false"],
    "decode on, gpus off": ["workers.decode.enabled=true"]
    + [f"workers.{s}.gpus=0" for s in GPU_STAGES],
    "existing secret, open api, no hpa": [
        "secrets.existingSecret=mine",
        "api.allowOpen=true",
        "api.autoscaling.enabled=false",
    ],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rendered_manifests_validate_against_the_official_schemas(
    helm: Path, validator: ManifestValidator, secret_values: list[str], variant: str
) -> None:
    sets = VARIANTS[variant]
    objects = render(helm, *([] if "secrets.existingSecret=mine" in sets else secret_values), *sets)
    assert objects
    assert [str(p) for p in validator.problems(objects)] == []


@pytest.fixture
def broken(default: Objects) -> Iterator[dict[str, dict[str, Any]]]:
    """Deep copies of rendered objects to break one field at a time."""
    import copy

    yield {
        "deployment": copy.deepcopy(of_kind(default, "Deployment")["encode"]),
        "scaled": copy.deepcopy(of_kind(default, "ScaledObject")["encode"]),
    }


def test_the_validation_rejects_broken_manifests(
    validator: ManifestValidator, broken: dict[str, dict[str, Any]]
) -> None:
    deployment, scaled = broken["deployment"], broken["scaled"]
    assert validator.problems([deployment, scaled]) == []
    deployment["spec"]["replicas"] = "three"
    container(deployment)["imagePullPolcy"] = "Always"  # a misspelt field: strict checks
    scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 20  # KEDA wants strings
    scaled["spec"]["minReplicas"] = 1  # the field is minReplicaCount
    found = {
        (p.obj.split("/")[0], p.path, p.message) for p in validator.problems([deployment, scaled])
    }
    paths = {(kind, path) for kind, path, _ in found}
    assert ("Deployment", "spec/replicas") in paths, found
    assert ("Deployment", "spec/template/spec/containers/0") in paths, found
    assert ("ScaledObject", "spec/triggers/0/metadata/lagThreshold") in paths, found
    assert ("ScaledObject", "spec") in paths, found
    assert any("imagePullPolcy" in m for _, _, m in found) and any(
        "minReplicas" in m for _, _, m in found
    )
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert [p.message for p in validator.problems([unknown])] != []


def test_kafka_trigger_metadata_is_checked_against_the_kafka_scalers_parameters(
    validator: ManifestValidator, broken: dict[str, dict[str, Any]]
) -> None:
    """What the CRD cannot see (metadata is a map of strings): KEDA's kafka scaler's own list."""
    scaled = broken["scaled"]
    metadata = scaled["spec"]["triggers"][0]["metadata"]
    metadata["lagTreshold"] = metadata.pop("lagThreshold")
    metadata["offsetResetPolicy"] = "oldest"
    del metadata["consumerGroup"]
    messages = sorted(p.message for p in validator.problems([scaled]))
    assert messages == [
        "missing required parameter 'consumerGroup'",
        "offsetResetPolicy='oldest' is not one of ['latest', 'earliest']",
        "unknown parameter 'lagTreshold'",
    ]


# --- the README's command ---------------------------------------------------------------------


def readme_helm_block() -> str:
    """The bash block of the README's "Kubernetes (Helm)" subsection."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n### Kubernetes (Helm)\n", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```bash\n(.*?)```", section.split("\n### ", 1)[0], flags=re.S)
    return block


def test_the_readme_install_command_renders_valid_manifests(
    helm: Path, validator: ManifestValidator
) -> None:
    """The README's `helm upgrade --install` line, run by bash as written (its `openssl`
    secrets included) with `template` in place of `upgrade --install`: no cluster here."""
    block = readme_helm_block()
    assert block.startswith("helm upgrade --install epd deploy/helm/epd-pipeline ")
    script = block.replace("helm upgrade --install", f"{helm} template", 1)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    objects = load_manifests(done.stdout)
    assert [str(p) for p in validator.problems(objects)] == []
    [configmap] = of_kind(objects, "ConfigMap").values()
    assert configmap["data"]["EPD_KAFKA_BOOTSTRAP"] == "kafka-0.kafka:9092,kafka-1.kafka:9092"
    assert all(o["metadata"].get("namespace", "epd") == "epd" for o in objects)


def test_the_validation_command_reports_and_fails(
    validator: ManifestValidator,
    broken: dict[str, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m tests.helm_schemas FILE``: what an operator runs on a render of their own."""
    import yaml

    from tests.helm_schemas import main

    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump_all([broken["deployment"], broken["scaled"]]))
    assert main([str(good)]) == 0
    assert "2 objects (Deployment, ScaledObject): 0 problems" in capsys.readouterr().out
    broken["deployment"]["spec"]["replicas"] = "three"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all([broken["deployment"]]))
    assert main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert 'at spec/replicas: "three" is not of type "integer"' in out
    assert "1 objects (Deployment): 1 problems" in out
