"""compose.yaml's `gateway` profile and docker/gateway.Dockerfile agree with smg's real flags and the frontend's
port, without Docker (as tests/observability/test_compose.py does for the two services)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse

import yaml
from packaging.requirements import Requirement
from smg.launch_router import parse_router_args

from services.frontend.__main__ import parse_args as frontend_parse_args

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "gateway.Dockerfile"


def compose_services(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["services"]


def test_the_gateway_profile_points_smg_at_the_frontend_with_its_real_flags():
    services = compose_services(ROOT / "compose.yaml")
    gateway = services["gateway"]
    assert gateway["profiles"] == ["gateway"] and gateway["build"]["dockerfile"] == "docker/gateway.Dockerfile"
    args = parse_router_args(gateway["command"])
    frontend = frontend_parse_args(services["frontend"]["command"])
    [worker] = args.worker_urls
    url = urlparse(worker)
    assert url.scheme == "grpc" and url.hostname == "frontend" and url.port == frontend.port
    assert {int(p.split(":")[1]) for p in gateway["ports"]} == {args.port, args.prometheus_port}
    assert gateway["depends_on"]["frontend"]["condition"] == "service_healthy"


def test_the_image_runs_the_pinned_smg_and_exposes_the_compose_ports():
    text = DOCKERFILE.read_text()
    pinned = re.search(r"pip install (smg==\S+)", text).group(1)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"{pinned}"' in pyproject, "the image and the test extra must run the same smg"
    assert Requirement(pinned).specifier.contains("1.13.0")
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", text, flags=re.M).group(1).split()}
    ports = {int(p.split(":")[1]) for p in compose_services(ROOT / "compose.yaml")["gateway"]["ports"]}
    assert exposed == ports
    cmd = json.loads(re.search(r"^CMD (\[.*?\])$", text.replace("\\\n", ""), flags=re.M | re.S).group(1))
    assert parse_router_args(cmd).host == "0.0.0.0"

