"""A client that knows no protos, as grpcurl: it learns every type from server reflection. It runs the
README's plaintext grpcurl examples against a live stack, and checks the health service names."""

from __future__ import annotations

import re
import shlex

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.clients.conftest import REPO

README_ADDRESS = "localhost:50051"


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


def readme_grpcurl_commands() -> list[list[str]]:
    """Every `grpcurl -plaintext ...` command in README.md's code blocks, split as a shell would."""
    commands, pending = [], ""
    for line in (REPO / "README.md").read_text().splitlines():
        if not pending and not line.startswith("grpcurl"):
            continue
        if line.endswith("\\"):  # continued on the next line
            pending += line[:-1] + " "
            continue
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quoted payload goes on over the next line
            continue
        if "-plaintext" in words:
            commands.append(words)
        pending = ""
    return commands


def parse(words: list[str]) -> tuple[str, list[tuple[str, str]], str]:
    """(payload, metadata, SERVICE/METHOD or list) of one grpcurl command."""
    payload, metadata, positional, i = "{}", [], [], 1
    while i < len(words):
        if words[i] == "-d":
            payload, i = words[i + 1], i + 2
        elif words[i] == "-H":
            key, value = words[i + 1].split(":", 1)
            metadata.append((key.strip().lower(), value.strip()))
            i += 2
        else:
            positional.append(words[i])
            i += 1
    positional.remove("-plaintext")
    assert positional[0] == README_ADDRESS, positional
    return payload, metadata, positional[1]


@pytest.fixture(scope="module")
def reflection(live_stack):
    with grpc.insecure_channel(live_stack.frontend_address) as channel:
        yield ReflectionClient(channel)


def test_the_readme_grpcurl_examples_run_from_reflection_alone(reflection):
    commands = [parse(words) for words in readme_grpcurl_commands()]
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
        assert responses[-1]["completions"][0]["finishReason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")


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
