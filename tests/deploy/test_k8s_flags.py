"""deploy/k8s against the services' real flag parsers: args, ConfigMap keys, ports, grace, telemetry.

Like tests/observability/test_compose.py for compose.yaml: every container's args (with $(VAR)
expanded from its ConfigMaps as the kubelet does) must parse with the parser the service runs, and
the ports, probes, Services, scrape annotations and termination grace must agree with those flags.
What is not checked here: that a cluster runs it (there is no cluster and no Docker daemon here).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import pytest

from services.engine.__main__ import build_parser as engine_parser
from services.engine.__main__ import config_from_args
from services.frontend.__main__ import parse_args as frontend_parse_args
from services.frontend.engines.discovery import EngineTarget, parse_engine_targets
from services.frontend.engines.router import RoutingPolicy
from services.security import flags as security_flags
from services.telemetry.flags import tracing_settings
from tests.deploy.conftest import (
    DEFAULT_NAMESPACE,
    ENGINE,
    PROBES,
    Probe,
    Rendered,
    Workload,
    probe_target,
    quantity_value,
)
from tests.security.pki import Pki

# After --grace runs out a service still finishes its step in flight, closes its server and flushes
# spans to the collector (the OTLP exporter's default timeout is 10 s): the pod needs this much more.
MIN_SHUTDOWN_MARGIN_S = 10
# Engine memory beyond its KV cache on CPU: SmolLM2-135M, torch and Python measured at 1.0 GiB peak
# (2.0 GiB resident with a 1 GiB KV cache, 16 concurrent streams).
ENGINE_CPU_OVERHEAD_GIB = 1.0
# Variables the processes read themselves (OpenTelemetry's SDK), so a ConfigMap key need not be an arg.
READ_FROM_ENVIRONMENT = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SDK_DISABLED",
                         "OTEL_SERVICE_NAME", "HOME"}


def materialized_args(workload: Workload, tmp_path: Path, pki: Pki) -> list[str]:
    """The args with each mounted Secret file written under tmp_path (certificates and keys from the
    test PKI by key name, a token otherwise) and the args pointed at those copies."""
    pems = {"ca.crt": pki.ca, "tls.crt": pki.server_cert, "tls.key": pki.server_key}
    args = workload.args()
    for path, (_, key) in workload.secret_files().items():
        local = tmp_path / path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(pems[key].read_bytes() if key in pems else f"test-{key}\n".encode())
        args = [f"{arg.split('=', 1)[0]}={local}" if arg.endswith(f"={path}") else arg for arg in args]
    return args


def engine_args(rendered: Rendered, tmp_path: Path, pki: Pki):
    """The engine's args parsed as tandem-engine does, its TLS files loaded."""
    args = engine_parser().parse_args(materialized_args(rendered.engine, tmp_path, pki))
    config_from_args(args)  # the engine's own value checks (device, sizes, dtype)
    security_flags.server_transport_from_args(args)
    return args


def frontend_args(rendered: Rendered, tmp_path: Path, pki: Pki):
    return frontend_parse_args(materialized_args(rendered.frontend, tmp_path, pki))  # loads TLS and tokens


def both(rendered: Rendered, tmp_path: Path, pki: Pki):
    """(workload, parsed args) of the engine, then of the frontend."""
    return ((rendered.engine, engine_args(rendered, tmp_path, pki)),
            (rendered.frontend, frontend_args(rendered, tmp_path, pki)))


def flag(workload: Workload, name: str) -> str | None:
    """A flag's value as written in the manifest (a path inside the container)."""
    values = [arg.split("=", 1)[1] for arg in workload.args() if arg.startswith(f"{name}=")]
    return values[-1] if values else None


def test_container_args_parse_with_the_real_flag_parsers(rendered, tmp_path, pki):
    ((_, engine), (_, frontend)) = both(rendered, tmp_path, pki)
    assert engine.host == frontend.host == "0.0.0.0"
    assert engine.otel and frontend.otel and engine.log_format == frontend.log_format == "json"
    assert engine.device == ("cuda" if rendered.overlay == "gpu" else "cpu")
    assert frontend.transport.interceptors, "the public API must require the token from the Secret"
    tls = rendered.overlay.endswith("-tls")
    assert bool(engine.tls_client_ca) == bool(frontend.engine_tls_cert) == bool(frontend.tls_cert) == tls


def test_every_configmap_key_is_used_and_every_variable_is_defined(rendered):
    for workload in (rendered.engine, rendered.frontend):
        name = workload.manifest["metadata"]["name"]
        undefined = [arg for arg in workload.args() if re.search(r"\$\(\w+\)", arg)]
        assert not undefined, f"{name}: args name variables its environment lacks: {undefined}"
        written = " ".join(workload.container["args"])
        for source in workload.container["envFrom"]:
            configmap = source["configMapRef"]["name"]
            unused = {key for key in rendered.configmaps[configmap]
                      if f"$({key})" not in written and key not in READ_FROM_ENVIRONMENT}
            assert not unused, f"{name}: keys of {configmap} nothing reads: {sorted(unused)}"


def test_ports_probes_and_services_agree_with_the_flags(rendered, tmp_path, pki):
    ((_, engine), (_, frontend)) = pairs = both(rendered, tmp_path, pki)
    for workload, args in pairs:
        name = workload.manifest["metadata"]["name"]
        assert workload.port("grpc") == args.port and workload.port("metrics") == args.metrics_port
        for kind in PROBES:
            probe = probe_target(workload.container[kind])
            assert probe.port == args.port, f"{name} {kind} probes port {probe.port}, the server listens on {args.port}"
            if kind != "livenessProbe" or name == ENGINE:
                assert probe.service is not None, f"{name} {kind} must ask the gRPC health service"
            check_probe_tls(workload, kind, probe)
        service = rendered.get("Service", name)
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] == "grpc" and port["port"] == args.port and port["appProtocol"] == "grpc"
    headless = rendered.get("Service", ENGINE)["spec"]
    assert headless["clusterIP"] == "None" and rendered.engine.manifest["spec"]["serviceName"] == ENGINE
    namespace = rendered.frontend.manifest["metadata"].get("namespace", DEFAULT_NAMESPACE)
    assert rendered.get("Service", ENGINE)["metadata"].get("namespace", DEFAULT_NAMESPACE) == namespace
    expected = EngineTarget(f"{ENGINE}.{namespace}.svc", engine.port, dns=True)
    assert parse_engine_targets(frontend.engine) == [expected], (
        "the frontend must discover every engine behind their headless Service (dns:///)")
    assert RoutingPolicy(frontend.routing_policy) is RoutingPolicy.PREFIX_AWARE


def check_probe_tls(workload: Workload, kind: str, probe: Probe) -> None:
    """A TLS port needs a probe that speaks TLS (the kubelet's gRPC probe cannot), trusting the CA of the
    server's own Secret and, where the server wants client certificates, presenting one."""
    name = f"{workload.manifest['metadata']['name']} {kind}"
    secrets = workload.secret_files()
    server_cert = flag(workload, "--tls-cert")
    if server_cert is None:
        assert probe.tls is None or not probe.tls.tls_ca, f"{name}: TLS probe against a plaintext port"
        return
    if probe.service is None:
        return  # a TCP check works the same under TLS
    assert probe.tls is not None and probe.tls.tls_ca, f"{name}: the port serves TLS, the probe must too"
    assert secrets[probe.tls.tls_ca][0] == secrets[server_cert][0], f"{name}: trust the CA in the server's Secret"
    if flag(workload, "--tls-client-ca"):
        assert probe.tls.tls_cert in secrets and probe.tls.tls_key in secrets, f"{name}: mutual TLS needs a client cert"


def test_drain_grace_fits_in_the_termination_grace_period(rendered, tmp_path, pki):
    for workload, args in both(rendered, tmp_path, pki):
        pre_stop = workload.container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        period = workload.pod["terminationGracePeriodSeconds"]
        assert args.grace > 0
        assert pre_stop + args.grace + MIN_SHUTDOWN_MARGIN_S <= period, (
            f"{workload.manifest['metadata']['name']}: preStop {pre_stop} s + --grace {args.grace:g} s + "
            f"{MIN_SHUTDOWN_MARGIN_S} s to shut down > terminationGracePeriodSeconds {period}: SIGKILL cuts the drain")


def test_metrics_are_annotated_for_prometheus_and_traces_go_to_the_otlp_endpoint(rendered, tmp_path, pki):
    for workload, args in both(rendered, tmp_path, pki):
        name = workload.manifest["metadata"]["name"]
        assert workload.annotations["prometheus.io/scrape"] == "true"
        assert int(workload.annotations["prometheus.io/port"]) == args.metrics_port
        assert workload.annotations["prometheus.io/path"] == "/metrics"
        env = workload.env()
        endpoint = urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert endpoint.scheme in ("http", "https") and endpoint.hostname and endpoint.port == 4317
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc" and env["OTEL_SERVICE_NAME"] == name
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("OTEL_SDK_DISABLED", env["OTEL_SDK_DISABLED"])
            assert tracing_settings(args, name).enabled, f"{name}: tracing is off"


def test_resources_fit_the_default_model_and_the_device(rendered, tmp_path, pki):
    engine = rendered.engine
    args = engine_args(rendered, tmp_path, pki)
    resources = engine.container["resources"]
    requests, limits = resources["requests"], resources["limits"]
    assert args.num_threads == quantity_value(requests["cpu"]), "torch threads must match the CPUs requested"
    assert quantity_value(limits["memory"]) >= quantity_value(requests["memory"])
    gpus = int(limits.get("nvidia.com/gpu", 0))
    if rendered.overlay == "gpu":
        assert gpus == 1 and args.device == "cuda"
        assert any(t["key"] == "nvidia.com/gpu" for t in engine.pod.get("tolerations", []))
    else:
        assert gpus == 0 and args.device == "cpu"
        needed = (args.kv_cache_memory_gib + ENGINE_CPU_OVERHEAD_GIB) * 2**30
        assert quantity_value(requests["memory"]) >= needed, "the KV cache and the model do not fit the request"
    frontend = rendered.frontend.container["resources"]
    assert quantity_value(frontend["requests"]["cpu"]) > 0, "the HPA's CPU utilization needs a CPU request"
    assert quantity_value(frontend["limits"]["memory"]) >= quantity_value(frontend["requests"]["memory"])
