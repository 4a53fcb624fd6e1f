"""Offline checks of the Kubernetes manifests in ops/kubernetes: each object is valid against
the Kubernetes schema, the two kustomizations build to the gpusched stack (dev: the same
parts, images and settings as docker-compose.yml), and every service is wired and probed.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from monitoring_files import DASHBOARD, RULES
from typer.testing import CliRunner

from gpusched_accounting.settings import AccountingSettings
from gpusched_agent.settings import AgentSettings
from gpusched_common.settings import KafkaSettings, RedisSettings, TelemetrySettings
from gpusched_ops import cli, stack
from gpusched_router.settings import RouterSettings
from gpusched_scheduler.settings import SchedulerSettings

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBE = REPO_ROOT / "ops" / "kubernetes"
JAEGER_CONFIG = REPO_ROOT / "ops" / "stack" / "jaeger" / "config.yaml"
KUBERNETES_VERSION = "1.30.0"
"""The oldest Kubernetes the manifests are checked against (policy/v1, startup probes and
runtime classes are older)."""
SETTINGS = {"gpusched_router": RouterSettings, "gpusched_scheduler": SchedulerSettings,
            "gpusched_accounting": AccountingSettings, "gpusched_agent": AgentSettings}
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator",
                    "generatorOptions", "patches"}

Obj = dict[str, Any]


def build(directory: Path) -> list[Obj]:
    """What `kubectl kustomize` makes of a kustomization that uses only KUSTOMIZE_FIELDS: its
    resources (folders recursively), the generated ConfigMaps (merged where asked), its
    patches (JSON patches of `replace` operations, on a kind and name), the namespace set on
    every object. Compared with kubectl itself below, where it is installed."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KUSTOMIZE_FIELDS
    assert not unknown, f"{directory}: build() does not apply {unknown}; extend it"
    objects: list[Obj] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        objects += build(path) if path.is_dir() else [
            doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for generator in spec.get("configMapGenerator", []):
        assert spec["generatorOptions"]["disableNameSuffixHash"]  # names stay as written
        data = dict(literal.split("=", 1) for literal in generator.get("literals", []))
        data |= {name: (directory / name).read_text() for name in generator.get("files", [])}
        same = [o for o in objects if o["kind"] == "ConfigMap"
                and o["metadata"]["name"] == generator["name"]]
        if generator.get("behavior") == "merge":
            [merged] = same
            merged["data"] |= data
        else:
            assert not same
            objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": generator["name"]}, "data": data})
    for patch in spec.get("patches", []):
        target = patch["target"]
        [obj] = [o for o in objects if o["kind"] == target["kind"]
                 and o["metadata"]["name"] == target["name"]]
        for operation in yaml.safe_load(patch["patch"]):
            assert operation["op"] == "replace", f"build() does not apply {operation}"
            *into, last = [int(p) if p.isdigit() else p
                           for p in operation["path"].strip("/").split("/")]
            holder = functools.reduce(lambda node, key: node[key], into, obj)
            assert last in holder if isinstance(holder, dict) else last < len(holder)
            holder[last] = operation["value"]
    for obj in objects:
        if "namespace" in spec and obj["kind"] != "Namespace":
            obj["metadata"]["namespace"] = spec["namespace"]
    return objects


BUILDS = {"production": KUBE, "dev": KUBE / "dev"}


@functools.cache
def _built(name: str) -> list[Obj]:
    return build(BUILDS[name])


def built(name: str) -> list[Obj]:
    """The objects of a build, a fresh copy for each test to change as it likes."""
    return copy.deepcopy(_built(name))


def named(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def gpusched_containers(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    """(workload, container) for every container that runs a gpusched service."""
    return [(w, c) for w in workloads(objects) for c in w["spec"]["template"]["spec"]["containers"]
            if c["image"].startswith("gpusched")]


def env_names(settings: type) -> set[str]:
    """The GPUSCHED_* variables a service's settings read."""
    own = {f"GPUSCHED_{f.upper()}" for f in settings.model_fields
           if f not in ("kafka", "redis", "telemetry")}
    return (own | {f"GPUSCHED_KAFKA_{f.upper()}" for f in KafkaSettings.model_fields}
            | {f"GPUSCHED_REDIS_{f.upper()}" for f in RedisSettings.model_fields}
            | {f"GPUSCHED_{f.upper()}" for f in TelemetrySettings.model_fields})


def _key(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_build_matches_kubectl_kustomize(name: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the offline build stands alone")
    out = subprocess.run([kubectl, "kustomize", str(BUILDS[name])], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    from_kubectl = sorted((d for d in yaml.safe_load_all(out) if d), key=_key)
    assert from_kubectl == sorted(built(name), key=_key)


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_every_object_is_valid_against_the_kubernetes_schema(name: str) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (ops[dev] has it)")
    for obj in built(name):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    # the check is not vacuous: a misspelt field fails it
    wrong = named(built(name), "Deployment")["router"]
    wrong["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSION, strict=True)


def test_production_runs_the_services_and_an_agent_per_gpu_node() -> None:
    objects = built("production")
    assert set(named(objects, "Deployment")) == {"router", "scheduler", "accounting"}
    assert set(named(objects, "DaemonSet")) == {"gpu-agent"}
    assert not named(objects, "StatefulSet")  # Kafka and Redis are the cluster's own
    assert named(objects, "Deployment")["scheduler"]["spec"]["replicas"] == 2  # + standby
    assert named(objects, "PodDisruptionBudget")["scheduler"]["spec"]["minAvailable"] == 1
    # the standby on another node than the leader wherever there is one: on the leader's,
    # it failed with it (minutes without placements, until Kubernetes evicted both)
    [spread] = named(objects, "Deployment")["scheduler"]["spec"]["template"]["spec"][
        "topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["maxSkew"], spread["whenUnsatisfiable"]) == (
        "kubernetes.io/hostname", 1, "DoNotSchedule")
    assert spread["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": "scheduler"}
    # counted otherwise, tainted nodes (GPU nodes, a control plane) and the rollout's old
    # pods held the standby or the rollout's new pod Pending
    assert spread["nodeTaintsPolicy"] == "Honor"
    assert spread["matchLabelKeys"] == ["pod-template-hash"]
    settings = named(objects, "ConfigMap")["gpusched-settings"]["data"]
    assert settings["GPUSCHED_KAFKA_REPLICATION_FACTOR"] == "3"
    assert "kafka:9092" not in settings["GPUSCHED_KAFKA_BOOTSTRAP"].split(",")


def test_the_gpu_agent_owns_its_node_and_drains_before_it_is_killed() -> None:
    agent = named(built("production"), "DaemonSet")["gpu-agent"]["spec"]["template"]["spec"]
    [container] = agent["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["GPUSCHED_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "GPUSCHED_SIMULATE" not in env  # NVML
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert agent["runtimeClassName"] == "nvidia"
    assert agent["terminationGracePeriodSeconds"] > AgentSettings().drain_timeout_s + 10


def test_a_stopped_router_has_the_time_to_answer_its_clients_wherever_it_runs() -> None:
    """SIGKILLed after Docker's default 10 s (Kubernetes' 30 s, the local stack's 15 s), a
    router stopped with clients waiting cut them off with no answer. Its grace period now
    covers its drain and 20 s for the shutdown after it (the broker stopped, spans flushed),
    the same in Compose, Kubernetes and the local stack."""
    from gpusched_ops.stack import SERVICE_STOP_TIMEOUT_S

    router = named(built("production"), "Deployment")["router"]["spec"]["template"]["spec"]
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    grace_s = SERVICE_STOP_TIMEOUT_S["router"]
    assert compose["router"]["stop_grace_period"] == f"{grace_s:g}s"
    assert grace_s >= RouterSettings().router_drain_s + 20
    # Kubernetes counts the preStop pause in the grace period
    [container] = router["containers"]
    pause_s = _pre_stop_sleep_s(container)
    assert router["terminationGracePeriodSeconds"] == grace_s + pause_s


def _pre_stop_sleep_s(container: dict) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return float(command[1])


def test_a_stopping_router_pod_keeps_taking_connections_until_it_leaves_the_endpoints(
) -> None:
    """Deleted, a pod is taken out of the Service's endpoints while it is told to stop;
    proxies keep sending it new connections for a few seconds. The router closes its
    listener on SIGTERM, so it pauses before it (preStop) and those are still served."""
    router = named(built("production"), "Deployment")["router"]["spec"]["template"]["spec"]
    [container] = router["containers"]
    assert 3 <= _pre_stop_sleep_s(container) <= 10


def test_dev_is_the_compose_stack() -> None:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    objects = built("dev")
    images = {c["name"]: c["image"] for w in workloads(objects)
              for c in w["spec"]["template"]["spec"]["containers"]}
    for infra in ("kafka", "redis", "jaeger"):
        assert images[infra] == compose[infra]["image"]
    assert {c["image"] for _, c in gpusched_containers(objects)} == {compose["router"]["image"]}
    settings = named(objects, "ConfigMap")["gpusched-settings"]["data"]
    for variable, value in compose["router"]["environment"].items():
        if variable not in ("GPUSCHED_HTTP_PORT", "GPUSCHED_CONFIG_DIR"):  # per service; image
            assert settings[variable] == value, variable
    agents = {}
    for w, c in gpusched_containers(objects):
        env = {e["name"]: e.get("value") for e in c["env"]}
        if "GPUSCHED_NODE_ID" in env:
            assert w["kind"] == "StatefulSet" and w["spec"]["replicas"] == 1  # one per node id
            agents[env["GPUSCHED_NODE_ID"]] = env["GPUSCHED_SIMULATE"]
    compose_agents = [compose[s]["environment"] for s in ("agent-1", "agent-2")]
    assert agents == {e["GPUSCHED_NODE_ID"]: e["GPUSCHED_SIMULATE"] for e in compose_agents}
    kafka = named(objects, "StatefulSet")["kafka"]["spec"]["template"]["spec"]["containers"][0]
    kafka_env = {e["name"]: e["value"] for e in kafka["env"]}
    assert kafka_env["KAFKA_ADVERTISED_LISTENERS"] == \
        f"PLAINTEXT://{settings['GPUSCHED_KAFKA_BOOTSTRAP']}"
    # Kafka refuses a log folder holding lost+found, as a fresh ext4 volume's root does
    [mount] = [m["mountPath"] for m in kafka["volumeMounts"]]
    assert kafka_env["KAFKA_LOG_DIRS"].startswith(mount.rstrip("/") + "/")
    # the broker and JVM settings as Compose's (the local stack's), off-heap bounds too:
    # without them, the one Kafka with a memory limit was killed rather than stopped
    listeners = {"KAFKA_LISTENERS", "KAFKA_ADVERTISED_LISTENERS",
                 "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"}
    assert {k: v for k, v in kafka_env.items() if k not in listeners} == \
        {k: v for k, v in compose["kafka"]["environment"].items() if k not in listeners}
    kafka_pod = named(objects, "StatefulSet")["kafka"]["spec"]["template"]["spec"]
    assert f"{kafka_pod['terminationGracePeriodSeconds']}s" == \
        compose["kafka"]["stop_grace_period"]
    redis = named(objects, "StatefulSet")["redis"]["spec"]["template"]["spec"]["containers"][0]
    # AOF, never evicting; as args, so the image's entrypoint still runs Redis as its own
    # user (Kubernetes' command replaces the image's entrypoint, Compose's only its CMD)
    assert "command" not in redis and redis["args"] == compose["redis"]["command"]
    # Jaeger runs the local stack's configuration with the settings stack.py gives it (the
    # image's own kept 100,000 traces, unlimited: past the pod's limit, killed)
    jaeger = named(objects, "Deployment")["jaeger"]["spec"]["template"]["spec"]
    [container] = jaeger["containers"]
    [mount] = container["volumeMounts"]
    [volume] = [v for v in jaeger["volumes"] if v["name"] == mount["name"]]
    config = named(objects, "ConfigMap")[volume["configMap"]["name"]]["data"]
    assert config == {"config.yaml": JAEGER_CONFIG.read_text()}
    assert container["args"] == ["--config", f"{mount['mountPath']}/config.yaml"]
    jaeger_env = {e["name"]: e["value"] for e in container["env"]}
    assert jaeger_env == compose["jaeger"]["environment"]
    assert set(jaeger_env) >= set(re.findall(r"\$\{env:(\w+)\}", config["config.yaml"]))
    assert (jaeger_env["JAEGER_MAX_TRACES"], jaeger_env["JAEGER_MEMORY_LIMIT_MIB"]) == (
        str(stack.JAEGER_MAX_TRACES), str(stack.JAEGER_MEMORY_LIMIT_MIB))
    [compose_mount] = compose["jaeger"]["volumes"]
    source, target = compose_mount.split(":")[:2]
    assert (REPO_ROOT / source).resolve() == JAEGER_CONFIG
    assert compose["jaeger"]["command"] == ["--config", target]


def cpu_requested(objects: list[Obj]) -> list[float]:
    """The CPUs each pod of the workloads asks for, one entry per replica."""
    def cpus(quantity: str) -> float:
        return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)

    return [sum(cpus(c["resources"]["requests"]["cpu"]) for c in w["spec"]["template"]["spec"][
        "containers"]) for w in workloads(objects) for _ in range(w["spec"].get("replicas", 1))]


def test_dev_fits_a_laptops_two_cpu_cluster_through_a_rolling_update() -> None:
    """It asked for 3.65 CPUs (the scheduler's production 1 CPU, twice): on minikube's
    default 2 CPUs, about 1.25 of them left by the control plane's requests, or kind on a
    2-core host, pods stayed Pending for 'Insufficient cpu'."""
    pods = cpu_requested(built("dev"))
    assert sum(pods) + max(pods) <= 1.25, (sum(pods), max(pods))
    assert max(cpu_requested(named(built("production"), "Deployment").values())) >= 1


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_every_service_reads_its_settings_listens_on_its_port_is_probed_and_scraped(
        name: str) -> None:
    objects = built(name)
    services = named(objects, "Service")
    shared = named(objects, "ConfigMap")["gpusched-settings"]["data"]
    containers = gpusched_containers(objects)
    assert len(containers) >= 4
    for workload, container in containers:
        settings = SETTINGS[container["command"][-1]]
        known = env_names(settings)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {n for n in env if n.startswith("GPUSCHED_")} <= known
        assert set(shared) <= known
        assert container["envFrom"] == [{"configMapRef": {"name": "gpusched-settings"}}]
        port = settings.model_fields["http_port"].default
        assert env["GPUSCHED_HTTP_PORT"] == str(port)
        assert container["ports"] == [{"name": "http", "containerPort": port}]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert workload["spec"]["template"]["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        selector = workload["spec"]["selector"]["matchLabels"]
        service = services.get(selector["app.kubernetes.io/name"])
        if service is not None and service["spec"].get("clusterIP") != "None":
            assert service["spec"]["selector"].items() <= selector.items()
            assert service["spec"]["ports"] == [{"name": "http", "port": port,
                                                 "targetPort": "http"}]


def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with In) selects `labels`."""
    return selector.get("matchLabels", {}).items() <= labels.items() and all(
        labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", ())
        if e["operator"] == "In")


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_the_prometheus_operator_objects_scrape_every_service_with_the_rules_and_dashboard(
        name: str) -> None:
    """`gpusched monitoring-manifests`: its PodMonitor selects every pod that serves
    /metrics, on its port, in both builds, and no other (Kafka, Redis, Jaeger); its
    PrometheusRule and dashboard ConfigMap hold ops/'s files as they are, with the labels
    asked for, so a cluster gets what promtool and the dashboard tests check."""
    out = CliRunner().invoke(cli.app, [
        "monitoring-manifests", "--label", "release=kube-prometheus-stack",
        "--dashboard-namespace", "monitoring"])
    assert out.exit_code == 0, out.output
    objects = {o["kind"]: o for o in yaml.safe_load_all(out.output)}
    assert set(objects) == {"PodMonitor", "PrometheusRule", "ConfigMap"}
    for obj in objects.values():
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    monitor = objects["PodMonitor"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    objs = built(name)
    pods = [w["spec"]["template"] for w in workloads(objs)]
    scraped = [p for p in pods if _selects(monitor["spec"]["selector"], p["metadata"]["labels"])]
    assert len(scraped) == len(gpusched_containers(objs)) >= 4
    for pod in scraped:
        [container] = pod["spec"]["containers"]
        assert container["image"].startswith("gpusched")
        assert endpoint["port"] in {p["name"] for p in container["ports"]}
        assert pod["metadata"]["annotations"]["prometheus.io/path"] == endpoint["path"]
    assert {o["metadata"]["namespace"] for o in objs if o["kind"] != "Namespace"} == {
        monitor["metadata"]["namespace"], objects["PrometheusRule"]["metadata"]["namespace"]}
    assert objects["PrometheusRule"]["spec"] == yaml.safe_load(RULES.read_text())
    dashboard = objects["ConfigMap"]
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["gpusched.json"]) == json.loads(DASHBOARD.read_text())
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (ops[dev] has it)")
    kubernetes_validate.validate(dashboard, KUBERNETES_VERSION, strict=True)
