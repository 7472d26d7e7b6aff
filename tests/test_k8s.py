"""The Kubernetes manifests: rendered by the real kustomize (`kubectl kustomize`, offline), validated against pinned
Kubernetes schemas, and cross-checked.

Core objects are validated with kubernetes-validate's strict schemas for KUBERNETES_VERSION; the
custom resources (Prometheus Operator, KEDA) have no schemas there and are checked against the objects they
point at. Container command lines are parsed by the services' own argument parsers, and the NATS server
configuration by the real nats-server; its users and permissions are shared/nats_roles.py's, and each service
connects as its own role with that role's password from the Secret.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from services import cli
from services.worker import metrics as worker_metrics
from shared import subjects
from shared.config import SpeculativeConfig
from shared.nats_roles import NatsRole, authorization_config, password_variable
from shared.nats_settings import NatsSettings

K8S = Path(__file__).resolve().parent.parent / "k8s"
KUSTOMIZATIONS = {
    "base": K8S / "base", **{name: K8S / "overlays" / name for name in ("gpu", "cpu-dev", "pd", "gpu-tp2")}
}
KUBERNETES_VERSION = "1.32"
CUSTOM_GROUPS = {"monitoring.coreos.com", "keda.sh"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
DASHBOARDS = {"specmesh-overview.json", "specmesh-speculative.json"}
VAR_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
GPU = "nvidia.com/gpu"
GPU_LOAD_BUDGET_S = 30 * 60  # a GPU worker's startupProbe: a large checkpoint's load and first compilations
UNPROBED_SIDECARS = {"exporter"}  # prometheus-nats-exporter: restarts with the pod, nothing depends on its readiness
POD_NAME = "specmesh-pod-0"  # stands in for fieldRef values when command lines are expanded
DECODE_GAUGES = {gauge.describe()[0].name for gauge in (worker_metrics.RUNNING, worker_metrics.WAITING)}

def kustomize(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize` renders from a kustomization directory."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl (with its built-in kustomize) is needed to render the manifests; install it")
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=True)
    return [o for o in yaml.safe_load_all(out.stdout) if o]


@pytest.fixture(scope="module", params=sorted(KUSTOMIZATIONS))
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, kustomize(KUSTOMIZATIONS[request.param])


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]


def one(objects: list[dict], kind: str, name: str) -> dict:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def pods_selected(objects: list[dict], selector: dict) -> list[dict]:
    """Workloads whose pod template carries every label of the selector."""
    return [w for w in workloads(objects) if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def port_names(workload: dict) -> set[str]:
    return {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}


def config_data(objects: list[dict]) -> dict[str, str]:
    return one(objects, "ConfigMap", "specmesh-config")["data"]


def secret_data(secret: dict) -> dict[str, str]:
    return {**secret.get("stringData", {}), **secret.get("data", {})}


def container_env(objects: list[dict], container: dict) -> dict[str, str]:
    """The environment the kubelet would give the container, with $(VAR) references expanded."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(one(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        ref = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "secretKeyRef" in ref:
            env[var["name"]] = secret_data(one(objects, "Secret", ref["secretKeyRef"]["name"]))[ref["secretKeyRef"]["key"]]
        elif "configMapKeyRef" in ref:
            env[var["name"]] = one(objects, "ConfigMap", ref["configMapKeyRef"]["name"])["data"][ref["configMapKeyRef"]["key"]]
        elif "fieldRef" in ref:
            env[var["name"]] = POD_NAME
        elif "resourceFieldRef" in ref:
            env[var["name"]] = "1"
        else:
            raise AssertionError(f"unknown env source for {var['name']}: {var}")
    return env


def expand(text: str, env: dict[str, str]) -> str:
    def substitute(match: re.Match) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not defined in the container's environment"
        return env[match.group(1)]

    return VAR_REFERENCE.sub(substitute, text)


def specmesh_containers(objects: list[dict]) -> list[tuple[dict, dict]]:
    return [(w, c) for w in workloads(objects) for c in w["spec"]["template"]["spec"]["containers"]
            if c["image"].startswith("specmesh:")]


def parse_command_line(argv: list[str]) -> tuple[str, argparse.Namespace, object]:
    """Parses argv exactly as `specmesh` does, without running anything."""
    try:
        module, args = cli.parse(argv, resolve=False)  # the model is not here: its checks run in the pod
        command = next(name for name, path in cli.COMMANDS.items() if path == module.__name__)
        return command, args, module
    except SystemExit:
        pytest.fail(f"specmesh rejects the command line {argv} (its message is in the captured stderr)")


def worker_deployments(objects: list[dict]) -> list[dict]:
    return [d for d in find(objects, "Deployment")
            if d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]


def worker_role(objects: list[dict], deployment: dict) -> str:
    """The --role its worker container runs with, as the worker's own parser reads it."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = container_env(objects, container)
    _, args, _ = parse_command_line([expand(a, env) for a in container["args"]])
    return args.role


def selectors_overlap(a: dict, b: dict) -> bool:
    """Whether a pod could carry both matchLabels selectors: they disagree on no key."""
    return all(b.get(key, value) == value for key, value in a.items())


def test_core_objects_match_the_kubernetes_schemas(rendered):
    _, objects = rendered
    for obj in objects:
        if obj["apiVersion"].split("/")[0] in CUSTOM_GROUPS:
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}")


def test_services_select_pods_and_target_their_ports(rendered):
    _, objects = rendered
    for service in find(objects, "Service"):
        selected = pods_selected(objects, service["spec"]["selector"])
        assert len(selected) == 1, f"Service {service['metadata']['name']} selects {len(selected)} workloads"
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names(selected[0]), f"{service['metadata']['name']}: {port}"
    for statefulset in find(objects, "StatefulSet"):
        one(objects, "Service", statefulset["spec"]["serviceName"])


def test_workload_selectors_probes_and_references(rendered):
    _, objects = rendered
    for workload in workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        spec = workload["spec"]["template"]["spec"]
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                one(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
            if "configMap" in volume:
                one(objects, "ConfigMap", volume["configMap"]["name"])
        volumes = {v["name"] for v in spec.get("volumes", [])} | claims
        for container in containers(workload):
            container_env(objects, container)  # every ConfigMap, Secret and key it names exists
            assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes
            ports = {p["name"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:
                    assert container[probe]["httpGet"]["port"] in ports, f"{container['name']} {probe}"
        for container in spec["containers"]:
            if container["name"] not in UNPROBED_SIDECARS:
                assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container), container["name"]


def test_specmesh_probes_use_health_for_liveness_and_ready_for_readiness(rendered):
    """A worker's /health answers while its model loads, so its start is over when it is first ready."""
    _, objects = rendered
    for workload, container in specmesh_containers(objects):
        component = workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        started = "/ready" if component == "worker" else "/health"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert container["startupProbe"]["httpGet"]["path"] == started, container["name"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_command_lines_parse_with_the_services_own_options(rendered):
    _, objects = rendered
    config = config_data(objects)
    nats_service = one(objects, "Service", "specmesh-nats")
    client_port = next(p["port"] for p in nats_service["spec"]["ports"] if p["name"] == "client")
    passwords = secret_data(one(objects, "Secret", "specmesh-nats"))
    for workload, container in specmesh_containers(objects):
        env = container_env(objects, container)
        command, args, _ = parse_command_line([expand(a, env) for a in container["args"]])
        assert workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == command
        url = urlsplit(args.nats_url)
        assert (url.hostname, url.port) == (nats_service["metadata"]["name"], client_port)
        # Each service is its own NATS user, its password from the environment: none on the command line.
        role = NatsRole(command)
        credentials = NatsSettings.from_args(args, role, env).credentials
        assert (credentials.user, credentials.password.get_secret_value()) == (role, passwords[password_variable(role)])
        assert url.username is None and not any(p in " ".join(container["args"]) for p in passwords.values())
        assert str(args.model) == config["MODEL_PATH"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if command == "gateway":
            assert (args.host, args.port) == ("0.0.0.0", ports["http"])
            assert args.served_model_name == config["SERVED_MODEL_NAME"]
        else:
            assert (args.metrics_host, args.metrics_port) == ("0.0.0.0", ports["metrics"])
        if command == "worker":
            SpeculativeConfig.from_json(args.speculative_config)
            assert (args.max_num_seqs, args.device) == (int(config["MAX_NUM_SEQS"]), config["DEVICE"])


def test_grace_periods_outlast_the_drains(rendered):
    _, objects = rendered
    for workload, container in specmesh_containers(objects):
        env = container_env(objects, container)
        command, args, module = parse_command_line([expand(a, env) for a in container["args"]])
        if command == "gateway":  # its requests' time to finish, then its handlers' time to write the 503
            drain_s = args.shutdown_timeout + module.HANDLERS_END_S
        else:
            drain_s = args.drain_timeout
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        grace_s = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace_s > pre_stop_s + drain_s, f"{command}: grace {grace_s}s, preStop {pre_stop_s}s + drain {drain_s}s"
    nats = one(objects, "StatefulSet", "specmesh-nats")
    conf = one(objects, "ConfigMap", "specmesh-nats-config")["data"]["nats.conf"]
    lame_duck_s = sum(int(s) for s in re.findall(r"^\s*lame_duck_(?:duration|grace_period):\s*(\d+)s$", conf, re.M))
    assert lame_duck_s > 0 and nats["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > lame_duck_s


def test_nats_server_accepts_its_configuration(rendered, tmp_path):
    _, objects = rendered
    statefulset = one(objects, "StatefulSet", "specmesh-nats")
    nats = next(c for c in statefulset["spec"]["template"]["spec"]["containers"] if c["name"] == "nats")
    config_path = tmp_path / "nats.conf"
    config_path.write_text(one(objects, "ConfigMap", "specmesh-nats-config")["data"]["nats.conf"])
    binary = shutil.which("nats-server", path=sysconfig.get_path("scripts")) or shutil.which("nats-server")
    result = subprocess.run([binary, "-c", str(config_path), "-t"], env=container_env(objects, nats),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert authorization_config() in config_path.read_text(), "the users and permissions of shared/nats_roles.py"
    assert nats["args"] == ["--config", "/etc/nats/nats.conf"]
    assert nats["lifecycle"]["preStop"]["exec"]["command"][:3] == ["nats-server", "--signal", "ldm=/var/run/nats/nats.pid"]
    assert "pid_file: /var/run/nats/nats.pid" in config_path.read_text()


def test_autoscalers_and_budgets_target_existing_workloads(rendered):
    _, objects = rendered
    for hpa in find(objects, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        one(objects, target["kind"], target["name"])
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    for pdb in find(objects, "PodDisruptionBudget"):
        assert len(pods_selected(objects, pdb["spec"]["selector"]["matchLabels"])) == 1
    components = {w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                  for pdb in find(objects, "PodDisruptionBudget")
                  for w in pods_selected(objects, pdb["spec"]["selector"]["matchLabels"])}
    assert components == {"gateway", "detokenizer", "worker"}


def test_monitors_scrape_named_ports_of_existing_pods(rendered):
    _, objects = rendered
    for monitor in find(objects, "PodMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        selected = pods_selected(objects, monitor["spec"]["selector"]["matchLabels"])
        assert len(selected) == 1, f"PodMonitor {monitor['metadata']['name']} selects {len(selected)} workloads"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in port_names(selected[0]) and endpoint["path"] == "/metrics"
    for monitor in find(objects, "ServiceMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        services = [s for s in find(objects, "Service")
                    if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert len(services) == 1, f"ServiceMonitor {monitor['metadata']['name']} selects {len(services)} Services"
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in {p["name"] for p in services[0]["spec"]["ports"]}
            assert endpoint["path"] == "/metrics"


def test_workers_scale_on_the_request_queue(rendered):
    """Workers that read the request queue (--role both or prefill) scale on its backlog; decode workers, which never
    read it, on the sequences they hold, from Prometheus. Either way one more worker per MAX_NUM_SEQS waiting."""
    name, objects = rendered
    max_num_seqs = config_data(objects)["MAX_NUM_SEQS"]
    triggers = []
    for scaled in find(objects, "ScaledObject"):
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        target = scaled["spec"]["scaleTargetRef"]
        worker = one(objects, target.get("kind", "Deployment"), target["name"])
        assert worker["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
        assert not find(objects, "HorizontalPodAutoscaler", target["name"]), "KEDA owns the worker's HPA"
        assert scaled["spec"]["minReplicaCount"] >= 1, "a worker must stay up to take the first request"
        assert scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
        (trigger,) = scaled["spec"]["triggers"]
        meta = trigger["metadata"]
        role = worker_role(objects, worker)
        triggers.append((role, trigger["type"]))
        if role == "decode":
            assert trigger["type"] == "prometheus"
            assert meta["threshold"] == max_num_seqs
            assert urlsplit(meta["serverAddress"]).scheme in {"http", "https"}
            # The decode pods' running and waiting sequences, of the pods this ScaledObject scales and no other.
            query = meta["query"]
            (metric_pattern,) = re.findall(r'__name__=~"([^"]+)"', query)
            assert query.startswith("sum(") and all(re.fullmatch(metric_pattern, g) for g in DECODE_GAUGES)
            (namespace,) = re.findall(r'namespace="([^"]+)"', query)
            assert namespace == worker["metadata"]["namespace"]
            (pods,) = re.findall(r'pod=~"([^"]+)"', query)
            for deployment in find(objects, "Deployment"):
                pod_name = f"{deployment['metadata']['name']}-7c9b5d8f4b-x2k4q"  # <deployment>-<template hash>-<id>
                assert bool(re.fullmatch(pods, pod_name)) == (deployment is worker), deployment["metadata"]["name"]
            continue
        assert trigger["type"] == "nats-jetstream"
        assert (meta["stream"], meta["consumer"]) == (subjects.REQUEST_STREAM, subjects.WORKER_CONSUMER)
        assert meta["lagThreshold"] == max_num_seqs
        nats = one(objects, "Service", "specmesh-nats")
        monitor_port = next(p["port"] for p in nats["spec"]["ports"] if p["name"] == "monitor")
        expected = f"specmesh-nats.{nats['metadata']['namespace']}.svc.cluster.local:{monitor_port}"
        assert meta["natsServerMonitoringEndpoint"] == expected
    if name == "pd":
        assert sorted(triggers) == [("decode", "prometheus"), ("prefill", "nats-jetstream")]


def test_dashboards_are_provisioned_for_the_grafana_sidecar(rendered):
    _, objects = rendered
    dashboards = one(objects, "ConfigMap", "specmesh-dashboards")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(dashboards["data"]) == DASHBOARDS
    for text in dashboards["data"].values():
        dashboard = json.loads(text)
        assert dashboard["title"] and isinstance(dashboard["panels"], list)


def test_a_tensor_parallel_worker_requests_a_gpu_per_rank():
    objects = kustomize(KUSTOMIZATIONS["gpu-tp2"])
    (container,) = one(objects, "Deployment", "specmesh-worker")["spec"]["template"]["spec"]["containers"]
    (size,) = [int(arg.split("=")[1]) for arg in container["args"] if arg.startswith("--tensor-parallel-size=")]
    assert size == 2 == container["resources"]["limits"][GPU] == container["resources"]["requests"][GPU]


def test_overlays_fit_their_hardware():
    for overlay in ("gpu", "pd"):
        gpu = kustomize(KUSTOMIZATIONS[overlay])
        for worker in worker_deployments(gpu):
            (container,) = worker["spec"]["template"]["spec"]["containers"]
            assert container["resources"]["limits"][GPU] == 1 == container["resources"]["requests"][GPU]
            assert container["image"].endswith("-cuda") and config_data(gpu)["DEVICE"] == "cuda"
            pod = worker["spec"]["template"]["spec"]
            assert pod["nodeSelector"] and pod["tolerations"]
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= GPU_LOAD_BUDGET_S
            assert startup["httpGet"]["path"] == "/ready"  # the patch kept the base's probe, only its budget grew

    dev = kustomize(KUSTOMIZATIONS["cpu-dev"])
    assert all(o["apiVersion"].split("/")[0] not in CUSTOM_GROUPS for o in dev), "cpu-dev needs no operator"
    assert not find(dev, "HorizontalPodAutoscaler")
    for workload in workloads(dev):
        assert workload["spec"]["replicas"] == 1
        for container in containers(workload):
            assert GPU not in json.dumps(container.get("resources", {}))
            assert not container["image"].endswith("-cuda")


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_images_fit_the_manifests(variant):
    dockerfile = (K8S.parent / "docker" / f"Dockerfile.{variant}").read_text()
    assert 'ENTRYPOINT ["specmesh"]' in dockerfile and "COPY models models" in dockerfile
    (uid,) = re.findall(r"^ARG SPECMESH_UID=(\d+)$", dockerfile, re.M)
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", dockerfile, re.M)
    for overlay in ("gpu", "pd") if variant == "cuda" else ("cpu-dev",):
        objects = kustomize(KUSTOMIZATIONS[overlay])
        for workload, container in specmesh_containers(objects):
            assert container["image"].endswith(f"-{variant}")
            assert workload["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid)
        for workload in workloads(objects):
            for init in workload["spec"]["template"]["spec"].get("initContainers", []):
                assert init["command"][2].startswith(f"{workdir}/models/"), "the demo model's place in the image"


def test_the_worker_has_a_cpu_limit_to_size_its_threads_by(rendered):
    """services/cpu_plan.py sizes the engine's torch threads from the cgroup's CPU limit; without one a pod would
    see every core of its node."""
    _, objects = rendered
    one(objects, "Deployment", "specmesh-worker")
    for deployment in worker_deployments(objects):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        resources = container["resources"]
        assert resources["limits"]["cpu"] == resources["requests"]["cpu"], deployment["metadata"]["name"]
        assert not any(variable["name"] == "OMP_NUM_THREADS" for variable in container.get("env", []))


def test_no_pod_has_two_budgets_or_two_monitors(rendered):
    """The eviction API refuses to evict a pod that two PodDisruptionBudgets cover, and Prometheus would count a pod
    scraped by two monitors twice in every sum; two Deployments whose selectors overlap fight over their pods."""
    _, objects = rendered

    def names(matching: list[dict]) -> list[str]:
        return [o["metadata"]["name"] for o in matching]

    def selecting(kind: str, labels: dict) -> list[dict]:
        """The objects of `kind` whose selector matches `labels`; a Service without a selector selects no pod."""
        selectors = [(o, o["spec"].get("selector")) for o in find(objects, kind)]
        selectors = [(o, s if kind == "Service" else s["matchLabels"]) for o, s in selectors if s is not None]
        return [o for o, s in selectors if s.items() <= labels.items()]

    for workload in workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        budgets = selecting("PodDisruptionBudget", labels)
        assert len(budgets) <= 1, f"{workload['metadata']['name']}: {names(budgets)}"
        monitors = selecting("PodMonitor", labels)
        for service in selecting("Service", labels):
            monitors += selecting("ServiceMonitor", service["metadata"]["labels"])
        assert len(monitors) <= 1, f"{workload['metadata']['name']}: {names(monitors)}"
    deployments = find(objects, "Deployment")
    for i, a in enumerate(deployments):
        for b in deployments[i + 1:]:
            assert not selectors_overlap(a["spec"]["selector"]["matchLabels"], b["spec"]["selector"]["matchLabels"]), (
                a["metadata"]["name"], b["metadata"]["name"])


def test_pd_runs_one_prefill_and_one_decode_deployment():
    objects = kustomize(KUSTOMIZATIONS["pd"])
    roles = sorted(((worker_role(objects, d), d) for d in worker_deployments(objects)), key=lambda pair: pair[0])
    assert [role for role, _ in roles] == ["decode", "prefill"], "exactly one Deployment of each role"
    (_, decode), (_, prefill) = roles
    # The gpu overlay's worker Deployment keeps its name and its ScaledObject: it is the prefill one.
    assert prefill["metadata"]["name"] == "specmesh-worker"
    assert not selectors_overlap(prefill["spec"]["selector"]["matchLabels"], decode["spec"]["selector"]["matchLabels"])
    for kind in ("PodDisruptionBudget", "PodMonitor", "ScaledObject"):
        covered = []
        for obj in find(objects, kind):
            if kind == "ScaledObject":
                selected = [one(objects, "Deployment", obj["spec"]["scaleTargetRef"]["name"])]
            else:
                selected = pods_selected(objects, obj["spec"]["selector"]["matchLabels"])
            assert len(selected) == 1, f"{kind}/{obj['metadata']['name']} selects {len(selected)} workloads"
            covered += [w["metadata"]["name"] for w in selected if w in (prefill, decode)]
        assert sorted(covered) == sorted([prefill["metadata"]["name"], decode["metadata"]["name"]]), kind
    # Both roles are the gpu overlay's worker apart from the role: same GPU, nodes, image, probes and drain.
    gpu_worker = one(kustomize(KUSTOMIZATIONS["gpu"]), "Deployment", "specmesh-worker")

    def without_role(deployment: dict) -> dict:
        spec = json.loads(json.dumps(deployment["spec"]))
        for labels in (spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"]):
            labels.pop("specmesh/worker-role")
        (container,) = spec["template"]["spec"]["containers"]
        container["args"] = [a for a in container["args"] if not a.startswith("--role")]
        return spec

    assert without_role(prefill) == gpu_worker["spec"] == without_role(decode)


def test_the_streams_are_declared_by_a_job_as_the_nats_admin(rendered):
    """The services' NATS users may not create or change streams (shared/streams.py): the Job declares them."""
    _, objects = rendered
    job = one(objects, "Job", "specmesh-streams")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = container_env(objects, container)
    command, args, _ = parse_command_line([expand(a, env) for a in container["args"]])
    assert command == "streams"
    nats_service = one(objects, "Service", "specmesh-nats")
    assert urlsplit(args.nats_url).hostname == nats_service["metadata"]["name"]
    credentials = NatsSettings.from_args(args, NatsRole.ADMIN, env).credentials
    passwords = secret_data(one(objects, "Secret", "specmesh-nats"))
    assert (credentials.user, credentials.password.get_secret_value()) == (
        NatsRole.ADMIN, passwords[password_variable(NatsRole.ADMIN)]
    )
    images = {c["image"] for _, c in specmesh_containers(objects)}
    assert images == {container["image"]}, "the Job runs the services' own image"
