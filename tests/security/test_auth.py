"""Bearer tokens on the public API: missing or wrong -> UNAUTHENTICATED, admin token separate, probes open."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tandem.v1 import admin_pb2, common_pb2, generation_pb2

from services.security import flags
from services.security.auth import BearerTokenInterceptor, TokenError, TokenPolicy, load_token
from services.security.transport import ServerTransport

API, ADMIN = "api-secret-1", "admin-secret-2"


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


def refused(frontend, call) -> grpc.aio.AioRpcError:
    async def run():
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call()
        return error.value

    error = frontend.run(run())
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
    return error


@pytest.fixture
def locked(make_frontend):
    return make_frontend(ServerTransport(interceptors=(BearerTokenInterceptor(TokenPolicy(API, ADMIN)),)))


# ---- loading tokens ------------------------------------------------------------------------------
def test_token_comes_from_the_file_else_the_env_var(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_TEST_TOKEN", raising=False)
    assert load_token(None, "TANDEM_TEST_TOKEN", flag="--api-token-file") is None
    monkeypatch.setenv("TANDEM_TEST_TOKEN", " from-env\n")
    assert load_token(None, "TANDEM_TEST_TOKEN", flag="--api-token-file") == "from-env"
    (tmp_path / "token").write_text("from-file\n")
    assert load_token(tmp_path / "token", "TANDEM_TEST_TOKEN", flag="--api-token-file") == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TokenError, match="--api-token-file: .*empty is empty"):
        load_token(tmp_path / "empty", "TANDEM_TEST_TOKEN", flag="--api-token-file")
    with pytest.raises(TokenError, match="--admin-token-file: cannot read .*missing"):
        load_token(tmp_path / "missing", "TANDEM_TEST_TOKEN", flag="--admin-token-file")


def test_token_flags_add_the_interceptor_only_when_a_token_is_set(tmp_path, monkeypatch):
    import argparse

    monkeypatch.delenv(flags.API_TOKEN_ENV, raising=False)
    monkeypatch.delenv(flags.ADMIN_TOKEN_ENV, raising=False)
    parser = argparse.ArgumentParser()
    flags.add_server_flags(parser, max_message_bytes=1 << 20, tokens=True)
    assert flags.server_transport_from_args(parser.parse_args([])).interceptors == ()
    monkeypatch.setenv(flags.ADMIN_TOKEN_ENV, ADMIN)
    (tmp_path / "api").write_text(API)
    (interceptor,) = flags.server_transport_from_args(
        parser.parse_args(["--api-token-file", str(tmp_path / "api")])).interceptors
    assert interceptor.policy == TokenPolicy(API, ADMIN)


def test_policy_rules():
    policy = TokenPolicy(api_token=API)
    assert policy.check("/tandem.v1.GenerationService/Tokenize", bearer(API)) is None
    assert policy.check("/tandem.v1.AdminService/Pause", bearer(API)) is None  # no admin token: the API token
    assert policy.check("/grpc.health.v1.Health/Check", ()) is None
    assert policy.check("/tandem.v1.Unknown/Call", ()).code == grpc.StatusCode.UNAUTHENTICATED  # default deny
    assert "must be 'Bearer <token>'" in policy.check("/tandem.v1.GenerationService/Tokenize",
                                                      (("authorization", f"Basic {API}"),)).message
    admin_only = TokenPolicy(admin_token=ADMIN)
    assert admin_only.check("/tandem.v1.GenerationService/Generate", ()) is None
    assert admin_only.check("/tandem.v1.AdminService/Drain", bearer(API)).code == grpc.StatusCode.UNAUTHENTICATED


# ---- on a real frontend -------------------------------------------------------------------------
def test_public_api_needs_the_api_token(locked):
    stub, _ = locked.stubs()
    tokenize = generation_pb2.TokenizeRequest(text="Hello there")
    missing = refused(locked, lambda: stub.Tokenize(tokenize))
    assert "tandem.v1.GenerationService needs the API token" in missing.details()
    assert "authorization: Bearer <token>" in missing.details()
    wrong = refused(locked, lambda: stub.Tokenize(tokenize, metadata=bearer("guess")))
    assert "not the API token" in wrong.details() and "guess" not in wrong.details()
    refused(locked, lambda: stub.Tokenize(tokenize, metadata=bearer(ADMIN)))
    assert len(locked.call(lambda: stub.Tokenize(tokenize, metadata=bearer(API))).token_ids) == 2


def test_streaming_generate_needs_the_api_token(locked):
    stub, _ = locked.stubs()
    request = generation_pb2.GenerateRequest(text="hi", sampling_params=common_pb2.SamplingParams(max_tokens=3))

    async def stream(metadata):
        return [r async for r in stub.Generate(request, metadata=metadata)]

    refused(locked, lambda: stream(()))
    refused(locked, lambda: stream(bearer("guess")))
    assert not locked.engine.added  # refused calls never reached the engine
    assert locked.run(stream(bearer(API)))[-1].usage.completion_tokens == 3


def test_admin_calls_need_the_separate_admin_token(locked):
    _, admin = locked.stubs()
    error = refused(locked, lambda: admin.Resume(admin_pb2.ResumeRequest(), metadata=bearer(API)))
    assert "not the admin token of tandem.v1.AdminService" in error.details()
    refused(locked, lambda: admin.Resume(admin_pb2.ResumeRequest()))
    assert locked.call(lambda: admin.Resume(admin_pb2.ResumeRequest(), metadata=bearer(ADMIN))).ok


def test_the_client_sends_its_admin_token_with_operator_calls_only(locked):
    from clients.async_client import AsyncTandemClient
    from clients.connection import RetryPolicy
    from clients.errors import TandemError

    async def run():
        async with AsyncTandemClient(locked.target, token=API, admin_token=ADMIN, retry=RetryPolicy(0)) as both:
            resumed, tokens = await both.resume(), await both.tokenize("Hello there")
        async with AsyncTandemClient(locked.target, token=API, retry=RetryPolicy(0)) as api_only:
            with pytest.raises(TandemError) as refused:
                await api_only.resume()
        return resumed, tokens, refused.value

    resumed, tokens, refused = locked.run(run())
    assert resumed.ok and len(tokens.token_ids) == 2
    assert refused.code == grpc.StatusCode.UNAUTHENTICATED and "admin token" in refused.message


def test_health_and_reflection_stay_open(locked):
    locked.stubs()
    channel = locked.channels[-1]

    async def probe():
        health = health_pb2_grpc.HealthStub(channel)
        status = (await health.Check(health_pb2.HealthCheckRequest(service=""))).status
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)  # what grpcurl `list` does
        replies = [r async for r in reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
        return status, {s.name for s in replies[0].list_services_response.service}

    status, services = locked.run(probe())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert {"tandem.v1.GenerationService", "tandem.v1.AdminService"} <= services


def test_tandem_serve_passes_the_token_flags_to_its_frontend(monkeypatch):
    from clients.cli import main as cli
    from clients.cli import serve_command
    from clients.local_stack import free_port

    stacks = []

    class RecordingStack:  # stands in for the two processes
        def __init__(self, **kwargs):
            stacks.append(kwargs)

        def start(self):
            raise RuntimeError("not started in this test")

        def stop(self): ...

    monkeypatch.setattr(serve_command, "LocalStack", RecordingStack)
    monkeypatch.setattr(serve_command.signal, "signal", lambda *args: None)
    ports = ["--port", str(free_port()), "--engine-port", str(free_port())]  # free here, whatever else runs
    assert cli.main(["serve", "--api-token-file", "api.token", "--max-message-bytes", "1024", *ports]) == 1
    assert cli.main(["serve", *ports]) == 1
    assert stacks[0]["frontend_args"] == ["--api-token-file", "api.token", "--max-message-bytes", "1024"]
    assert stacks[1]["frontend_args"] == []
