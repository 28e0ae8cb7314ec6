"""deploy/k8s rendered as `kubectl apply -k` would send it, and the pod-level views the checks need.

kustomize is built into kubectl, so `kubectl kustomize OVERLAY` renders an overlay exactly (generated
ConfigMap names with their hashes, merged patches, images); the checks skip when kubectl is absent.
Nothing here talks to a cluster.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.observability.conftest import make_stack, observed_engine_config, tokenizer  # noqa: F401
from tests.security.pki import Pki, make_pki

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
ENGINE, FRONTEND = "tandem-engine", "tandem-frontend"
DEFAULT_NAMESPACE = "default"  # where an overlay without `namespace:` lands (kubectl's default)
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _load_healthcheck():
    spec = importlib.util.spec_from_file_location("docker_healthcheck", ROOT / "docker" / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = _load_healthcheck()  # docker/healthcheck.py, the exec probes' command


@dataclass(frozen=True)
class Probe:
    """What one probe checks: the port, and the health service name (None for a TCP check)."""

    port: int
    service: str | None
    tls: argparse.Namespace | None = None  # docker/healthcheck.py's flags, for an exec probe


def probe_target(probe: dict) -> Probe:
    if "grpc" in probe:
        return Probe(probe["grpc"]["port"], probe["grpc"].get("service", ""))
    if "tcpSocket" in probe:
        return Probe(probe["tcpSocket"]["port"], None)
    command = probe["exec"]["command"]
    assert command[:2] == ["python", "/app/docker/healthcheck.py"], f"unexpected exec probe {command}"
    args = healthcheck.parse_args(command[2:])
    return Probe(int(args.address.rsplit(":", 1)[1]), args.service, args)


@dataclass(frozen=True)
class Workload:
    """One Deployment or StatefulSet with its single container, in a rendered overlay."""

    manifest: dict
    configmaps: dict[str, dict[str, str]]  # name -> data, of the same overlay

    @property
    def pod(self) -> dict:
        return self.manifest["spec"]["template"]["spec"]

    @property
    def labels(self) -> dict[str, str]:
        return self.manifest["spec"]["template"]["metadata"]["labels"]

    @property
    def annotations(self) -> dict[str, str]:
        return self.manifest["spec"]["template"]["metadata"].get("annotations", {})

    @property
    def container(self) -> dict:
        (container,) = self.pod["containers"]
        return container

    def env(self) -> dict[str, str]:
        """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env."""
        values: dict[str, str] = {}
        for source in self.container.get("envFrom", []):
            values.update(self.configmaps[source["configMapRef"]["name"]])
        for var in self.container.get("env", []):
            values[var["name"]] = self._value(var)
        return values

    def _value(self, var: dict) -> str:
        if "value" in var:
            return var["value"]
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self.configmaps[ref["name"]][ref["key"]]
        if "fieldRef" in source:  # the downward API: only the pod's namespace is used
            assert source["fieldRef"]["fieldPath"] == "metadata.namespace", source
            return self.manifest["metadata"].get("namespace", DEFAULT_NAMESPACE)
        if "resourceFieldRef" in source:  # e.g. requests.cpu with divisor 1: whole CPUs, rounded up
            ref = source["resourceFieldRef"]
            kind, resource = ref["resource"].split(".", 1)
            quantity = self.container["resources"][kind][resource]
            return str(math.ceil(quantity_value(quantity) / quantity_value(ref.get("divisor", "1"))))
        raise AssertionError(f"{var['name']}: unsupported valueFrom {source}")

    def args(self) -> list[str]:
        """The args with $(VAR) expanded from the environment, as the kubelet does ($$ escapes a $)."""
        env = self.env()

        def expand(match: re.Match) -> str:
            if match.group(0) == "$$":
                return "$"
            return env.get(match.group(1), match.group(0))  # an unknown variable stays as written

        return [re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, arg) for arg in self.container["args"]]

    def secret_files(self) -> dict[str, tuple[str, str]]:
        """Path in the container -> (Secret name, key), for every mounted Secret item."""
        mounts = {m["name"]: m["mountPath"] for m in self.container.get("volumeMounts", [])}
        files = {}
        for volume in self.pod.get("volumes", []):
            if "secret" in volume and volume["name"] in mounts:
                for item in volume["secret"]["items"]:
                    files[f"{mounts[volume['name']]}/{item['path']}"] = (volume["secret"]["secretName"], item["key"])
        return files

    def port(self, name: str) -> int:
        (port,) = [p["containerPort"] for p in self.container["ports"] if p["name"] == name]
        return port


@dataclass(frozen=True)
class Rendered:
    """One overlay's objects."""

    overlay: str
    docs: list[dict]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    @property
    def configmaps(self) -> dict[str, dict[str, str]]:
        return {d["metadata"]["name"]: d.get("data", {}) for d in self.of_kind("ConfigMap")}

    @property
    def engine(self) -> Workload:
        return Workload(self.get("StatefulSet", ENGINE), self.configmaps)

    @property
    def frontend(self) -> Workload:
        return Workload(self.get("Deployment", FRONTEND), self.configmaps)


@functools.cache
def render(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found: it renders the kustomizations (kustomize is built into kubectl)")
    result = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {path.relative_to(ROOT)}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("k8s-pki"))


@pytest.fixture(scope="session", params=OVERLAYS)
def rendered(request) -> Rendered:
    """Each overlay in turn."""
    return Rendered(request.param, render(K8S / "overlays" / request.param))


@pytest.fixture(scope="session")
def overlays() -> dict[str, Rendered]:
    """Every overlay at once, by name."""
    return {name: Rendered(name, render(K8S / "overlays" / name)) for name in OVERLAYS}


_SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_value(quantity: str | int | float) -> float:
    """A Kubernetes quantity ("500m", "3Gi", 2) as a number (CPUs, bytes)."""
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(quantity))
    assert match and match.group(2) in ("", *_SUFFIXES), f"unsupported quantity {quantity!r}"
    return float(match.group(1)) * _SUFFIXES.get(match.group(2), 1)
