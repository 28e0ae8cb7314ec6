"""A client that knows no protos, as grpcurl: it learns every type from server reflection. It runs the
plaintext `buf curl` examples of the README and docs/ against a live stack (and with buf itself where
`make install` put it), and checks the health service names."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from urllib.parse import urlsplit

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.clients.conftest import REPO

DOCS_ADDRESS = "localhost:50051"  # where the examples find the frontend
DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


class ReflectionClient:
    """grpcurl's `list` and `-d JSON SERVICE/METHOD`, with descriptors fetched from the server."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.database = ProtoReflectionDescriptorDatabase(channel)
        self.pool = descriptor_pool.DescriptorPool(self.database)

    def list(self) -> set[str]:
        return set(self.database.get_services())

    def call(self, full_method: str, payload: str = "{}", metadata=()):
        """(the method's descriptor, its responses as JSON dicts); a streaming method's in order."""
        service, name = full_method.split("/")
        method = self.pool.FindServiceByName(service).methods_by_name[name]
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        kind = self.channel.unary_stream if method.server_streaming else self.channel.unary_unary
        rpc = kind(f"/{full_method}", request_serializer=request_class.SerializeToString,
                   response_deserializer=response_class.FromString)
        reply = rpc(json_format.Parse(payload, request_class()), metadata=metadata, timeout=60)
        responses = list(reply) if method.server_streaming else [reply]
        return method, [json_format.MessageToDict(r) for r in responses]


# docs/tools.md's example forces a tool call: it ends with TOOL_CALLS, or LENGTH in the test stack's short context
FINISHED = ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH", "FINISH_REASON_TOOL_CALLS")


def documented_buf_curl_commands() -> list[list[str]]:
    """Every plaintext `buf curl ... http://...` command in the README's and docs/'s code blocks, split as a
    shell would."""
    commands, pending = [], ""
    for line in (line for page in DOC_PAGES for line in page.read_text().splitlines()):
        if not pending and not line.startswith("buf curl"):
            continue
        if line.endswith("\\"):  # continued on the next line
            pending += line[:-1] + " "
            continue
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quoted payload goes on over the next line
            continue
        if any(word.startswith("http://") for word in words):
            commands.append(words)
        pending = ""
    return commands


def parse(words: list[str]) -> tuple[str, list[tuple[str, str]], str]:
    """(payload, metadata, SERVICE/METHOD or list) of one buf curl command."""
    payload, metadata, target, i = "{}", [], None, 2
    assert words[:2] == ["buf", "curl"], words
    while i < len(words):
        word = words[i]
        if word in ("-d", "--data"):
            payload, i = words[i + 1], i + 2
        elif word in ("-H", "--header"):
            key, value = words[i + 1].split(":", 1)
            metadata.append((key.strip().lower(), value.strip()))
            i += 2
        elif word == "--protocol":
            assert words[i + 1] == "grpc", words  # buf curl's default is Connect, which the servers do not speak
            i += 2
        elif word in ("--list-services", "--list-methods"):
            target, i = "list", i + 1
        elif word == "--http2-prior-knowledge":  # plaintext gRPC needs HTTP/2 from the start
            i += 1
        else:
            url = urlsplit(word)
            assert (url.scheme, url.netloc) == ("http", DOCS_ADDRESS), word
            target = target or url.path.lstrip("/")
            i += 1
    assert "--http2-prior-knowledge" in words, words
    return payload, metadata, target


@pytest.fixture(scope="module")
def reflection(live_stack):
    with grpc.insecure_channel(live_stack.frontend_address) as channel:
        yield ReflectionClient(channel)


def test_the_documented_buf_curl_examples_run_from_reflection_alone(reflection):
    commands = [parse(words) for words in documented_buf_curl_commands()]
    assert len(commands) >= 3 and any(target == "list" for _, _, target in commands), commands
    for payload, metadata, target in commands:
        if target == "list":
            services = reflection.list()
            assert {"tandem.v1.GenerationService", "tandem.v1.AdminService", "grpc.health.v1.Health"} <= services
            assert not services & {"tandem.v1.Generation", "tandem.v1.Admin"}, services
            continue
        method, responses = reflection.call(target, payload, metadata)
        assert re.fullmatch(r"tandem\.v1\.\w+Service/\w+", target), target
        assert method.output_type.full_name == f"tandem.v1.{method.name}Response"  # one response type per RPC
        assert responses[-1]["usage"]["completionTokens"] > 0, responses[-1]
        assert responses[-1]["completions"][0]["finishReason"] in FINISHED


def test_the_documented_buf_curl_examples_run_as_written(live_stack):
    buf = REPO / "clients" / "node" / "node_modules" / ".bin" / "buf"
    if not buf.exists():
        pytest.skip("buf is not installed: make install runs npm ci in clients/node (needs npm)")
    for words in documented_buf_curl_commands():
        words = [w.replace(f"http://{DOCS_ADDRESS}", f"http://{live_stack.frontend_address}") for w in words]
        result = subprocess.run([str(buf), *words[1:]], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (words, result.stderr)
        if "--list-services" in words:
            assert "tandem.v1.GenerationService" in result.stdout.split()
            continue
        decoder, text, messages = json.JSONDecoder(), result.stdout.strip(), []
        while text:  # one JSON document per streamed message
            message, end = decoder.raw_decode(text)
            messages.append(message)
            text = text[end:].strip()
        assert messages[-1]["completions"][0]["finishReason"] in FINISHED


def test_unary_and_admin_calls_from_reflection(reflection):
    method, [model] = reflection.call("tandem.v1.GenerationService/GetModelInfo")
    assert method.output_type.full_name == "tandem.v1.GetModelInfoResponse" and model["maxModelLen"] > 0
    method, [tokens] = reflection.call("tandem.v1.GenerationService/Tokenize", '{"text": "Hello world"}')
    assert method.output_type.full_name == "tandem.v1.TokenizeResponse" and tokens["tokenIds"]
    method, [reset] = reflection.call("tandem.v1.AdminService/ResetPrefixCache")
    assert method.input_type.full_name == "tandem.v1.ResetPrefixCacheRequest"
    assert method.output_type.full_name == "tandem.v1.ResetPrefixCacheResponse" and reset["ok"], reset


@pytest.mark.parametrize("side, service", [
    ("frontend", "tandem.v1.GenerationService"), ("frontend", "tandem.v1.AdminService"),
    ("engine", "tandem.v1.EngineCoreService"),
])
def test_health_is_reported_under_the_service_names(live_stack, side, service):
    address = live_stack.frontend_address if side == "frontend" else live_stack.engine_address
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        old_name = service.removesuffix("Service")
        with pytest.raises(grpc.RpcError) as error:
            health.Check(health_pb2.HealthCheckRequest(service=old_name), timeout=10)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
