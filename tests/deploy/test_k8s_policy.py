"""deploy/k8s's wiring and policies: selectors, NetworkPolicies, disruption budgets, autoscaling,
security contexts, Secrets, and the overlays' images.

Checked on the rendered objects only: whether a CNI enforces the NetworkPolicies, an admission
policy accepts the security contexts or the images run on a node is not checked (no cluster here).
"""

from __future__ import annotations

import re

import pytest

from tests.deploy.conftest import ENGINE, FRONTEND, ROOT, Rendered, Workload

DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"  # the commands a cluster operator runs
DOC_SECTION = "## Kubernetes: from a cluster to a streamed answer"


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, or a Service's plain map) matches `labels`."""
    wanted = selector.get("matchLabels", selector)
    assert "matchExpressions" not in selector, "only matchLabels selectors are used here"
    return bool(wanted) and all(labels.get(key) == value for key, value in wanted.items())


def workloads(rendered: Rendered) -> dict[str, Workload]:
    return {ENGINE: rendered.engine, FRONTEND: rendered.frontend}


def test_services_and_budgets_select_exactly_their_own_pods(rendered):
    pods = workloads(rendered)
    for name, workload in pods.items():
        other = pods[FRONTEND if name == ENGINE else ENGINE]
        assert selects(workload.manifest["spec"]["selector"], workload.labels)
        for kind in ("Service", "PodDisruptionBudget"):
            selector = rendered.get(kind, name)["spec"]["selector"]
            assert selects(selector, workload.labels), f"{kind}/{name} does not select its pods"
            assert not selects(selector, other.labels), f"{kind}/{name} also selects the other service's pods"
        for constraint in workload.pod.get("topologySpreadConstraints", []):
            assert selects(constraint["labelSelector"], workload.labels)


def test_only_frontends_reach_the_engines_and_only_prometheus_the_metrics(rendered):
    engine, frontend = rendered.engine, rendered.frontend
    policy = rendered.get("NetworkPolicy", ENGINE)["spec"]
    assert selects(policy["podSelector"], engine.labels) and policy["policyTypes"] == ["Ingress"]
    by_port: dict[str, list[dict]] = {}
    for rule in policy["ingress"]:
        assert rule.get("from"), "an engine ingress rule without `from` lets every pod in"
        for port in rule["ports"]:
            by_port.setdefault(port["port"], []).extend(rule["from"])
    assert set(by_port) == {"grpc", "metrics"} and {p["name"] for p in engine.container["ports"]} == set(by_port)
    (grpc_peer,) = by_port["grpc"]
    assert set(grpc_peer) == {"podSelector"}, "the engine port admits pods of this namespace only"
    assert selects(grpc_peer["podSelector"], frontend.labels) and not selects(grpc_peer["podSelector"], engine.labels)
    for name, workload in workloads(rendered).items():
        spec = rendered.get("NetworkPolicy", name)["spec"]
        assert selects(spec["podSelector"], workload.labels)
        scrapers = [peer for rule in spec["ingress"] if any(p["port"] == "metrics" for p in rule["ports"])
                    for peer in rule.get("from", [None])]
        assert scrapers and all(peer and selects(peer["podSelector"], {"app.kubernetes.io/name": "prometheus"})
                                for peer in scrapers), f"{name}: metrics must be open to Prometheus only"


def test_frontends_autoscale_and_evictions_keep_both_services_up(rendered):
    deployment = rendered.frontend.manifest
    hpa = rendered.get("HorizontalPodAutoscaler", FRONTEND)["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"], target["apiVersion"]) == ("Deployment", FRONTEND, deployment["apiVersion"])
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count; `kubectl apply` would reset it"
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"]
    assert hpa["minReplicas"] - rendered.get("PodDisruptionBudget", FRONTEND)["spec"]["maxUnavailable"] >= 1
    engines = rendered.engine.manifest["spec"]["replicas"]
    assert engines - rendered.get("PodDisruptionBudget", ENGINE)["spec"]["maxUnavailable"] >= 1


def test_pods_run_as_the_image_user_with_a_read_only_root_filesystem(rendered):
    uids = {int(uid) for path in (ROOT / "docker").glob("*.Dockerfile")
            for uid in re.findall(r"useradd\b.*--uid (\d+)", path.read_text())}
    assert len(uids) == 1, f"the Dockerfiles disagree on the user's uid: {uids}"
    for name, workload in workloads(rendered).items():
        pod = workload.pod
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] in uids
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        context = workload.container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"] and context.get("privileged") is not True
        scratch = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        writable = {m["mountPath"] for m in workload.container["volumeMounts"]
                    if m["name"] in scratch and not m.get("readOnly")}
        home = workload.env()["HOME"]
        assert any(home == path or home.startswith(path + "/") for path in writable), (
            f"{name}: HOME={home} (Triton's and CUDA's caches) is not on a writable volume")


def secret_references(rendered: Rendered) -> dict[str, set[str]]:
    """Secret name -> keys, over every Secret volume and secretKeyRef of both workloads."""
    refs: dict[str, set[str]] = {}
    for workload in workloads(rendered).values():
        for volume in workload.pod["volumes"]:
            if "secret" in volume:
                secret = volume["secret"]
                assert secret.get("items"), f"{volume['name']}: list the keys, so a missing one fails the pod"
                refs.setdefault(secret["secretName"], set()).update(i["key"] for i in secret["items"])
        for var in workload.container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs.setdefault(ref["name"], set()).add(ref["key"])
    return refs


def doc_section() -> str:
    """docs/deployment.md's Kubernetes section, continued lines joined."""
    text = DEPLOYMENT_DOC.read_text()
    assert DOC_SECTION in text, f"{DEPLOYMENT_DOC.name} has no section {DOC_SECTION!r}"
    return text.split(DOC_SECTION, 1)[1].split("\n## ", 1)[0].replace("\\\n", " ")


def documented_secrets() -> dict[str, set[str]]:
    """Secret name -> keys, from the `kubectl create secret` commands of the docs' Kubernetes section."""
    section = doc_section()
    secrets: dict[str, set[str]] = {}
    for kind, name, rest in re.findall(r"create secret (generic|tls) ([\w.-]+)([^\n]*)", section):
        keys = set(re.findall(r"--from-(?:file|literal)=([\w.-]+)=", rest))
        secrets[name] = keys | ({"tls.crt", "tls.key"} if kind == "tls" else set())
    return secrets


def test_the_secrets_mounted_are_the_ones_the_docs_create(rendered):
    created = documented_secrets()
    for name, keys in secret_references(rendered).items():
        assert name in created, f"Secret {name} is mounted but docs/deployment.md never creates it"
        assert keys <= created[name], f"Secret {name}: docs/deployment.md creates no key {sorted(keys - created[name])}"
    for workload in workloads(rendered).values():
        assert workload.pod["securityContext"]["fsGroup"]
        for volume in workload.pod["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] & 0o040, "Secret files are root:fsGroup: the group must read"
                assert volume["secret"]["defaultMode"] & 0o007 == 0, "Secret files must not be world-readable"


def test_the_gpu_overlay_runs_the_cuda_image_the_docs_build(overlays):
    if "gpu" not in overlays:
        pytest.fail("deploy/k8s/overlays/gpu is missing")
    dockerfile = (ROOT / "docker" / "engine.Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_INDEX=", dockerfile, flags=re.M)
    section = doc_section()
    built = dict(re.findall(r"--build-arg TORCH_INDEX=(\S+) -t \S*?tandem-engine:(\S+)", section))
    images = {name: rendered.engine.container["image"] for name, rendered in overlays.items()}
    gpu_tag = images["gpu"].rsplit(":", 1)[1]
    assert gpu_tag in built.values() and next(i for i, t in built.items() if t == gpu_tag).startswith("cu")
    assert images["cpu"] != images["gpu"], "the CPU overlay must not run the CUDA image (or the reverse)"
    for name, rendered in overlays.items():
        assert ":" in rendered.frontend.container["image"] and ":" in images[name], "pin image tags"
