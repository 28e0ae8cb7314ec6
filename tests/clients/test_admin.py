"""Operator calls from the Python clients and `tandem admin`, against the live stack (tiny model, real processes).

The stack is shared by the client tests: every test here leaves it awake, resumed and not draining, even when
it fails (the `address` fixture wakes and resumes it afterwards).
"""

from __future__ import annotations

import json
import time

import grpc
import pytest

from clients.admin import PAUSE_MODES, AdminResult
from clients.async_client import AsyncTandemClient
from clients.cli.main import build_parser
from clients.cli.options import token_from_args
from clients.client import TandemClient
from clients.connection import RetryPolicy
from clients.errors import TandemError
from tests.clients.conftest import run_async, run_cli
from tests.waits import STATE_TIMEOUT_S

DONE = AdminResult(True, "done on 1 engine(s)")


@pytest.fixture
def address(live_stack):
    yield live_stack.frontend_address
    with TandemClient(live_stack.frontend_address, timeout=60) as client:
        client.wake_up(), client.resume()  # wake first: a resumed engine that still sleeps refuses requests
        deadline = time.monotonic() + STATE_TIMEOUT_S
        while client.health() != "SERVING":
            assert time.monotonic() < deadline, "the shared stack did not come back to SERVING"
            time.sleep(0.05)


def cli(*args: str, address: str):
    """`tandem ARGS --address ADDRESS --retries 0` (no retries: a refusal shows at once)."""
    return run_cli(*args, "--address", address, "--retries", "0")


def info_json(address: str) -> dict:
    result = cli("info", "--json", address=address)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["server"]


def test_pause_help_names_every_mode_and_what_it_does():
    result = run_cli("admin", "pause", "--help")
    assert result.returncode == 0, result.stderr
    for name, (_, meaning) in PAUSE_MODES.items():
        assert f"  {name:<6} {meaning}" in result.stdout
    listing = run_cli("admin", "--help").stdout
    for action in ("pause", "resume", "sleep", "wake", "reset-prefix-cache", "drain", "profile"):
        assert f"    {action}" in listing, action


def test_admin_pause_keep_and_resume_show_in_health_and_info(address):
    paused = cli("admin", "pause", "--mode", "keep", address=address)
    assert (paused.returncode, paused.stdout) == (0, "done on 1 engine(s)\n"), paused.stderr
    health = cli("health", address=address)
    assert (health.returncode, health.stdout) == (1, "NOT_SERVING\n")
    admin_health = cli("health", "--service", "tandem.v1.AdminService", address=address)
    assert (admin_health.returncode, admin_health.stdout) == (0, "SERVING\n")
    text = cli("info", address=address).stdout
    assert "state          not serving: every engine is paused or asleep" in text and "paused (keep)" in text
    (engine,) = info_json(address)["engines"]
    assert (engine["paused"], engine["pause_mode"], engine["asleep"]) == (True, "PAUSE_MODE_KEEP", False)

    resumed = cli("admin", "resume", address=address)
    assert resumed.returncode == 0, resumed.stderr
    assert cli("health", address=address).stdout == "SERVING\n"
    assert "state          serving" in cli("info", address=address).stdout


def test_admin_sleep_makes_new_requests_unavailable_until_wake(address):
    assert cli("admin", "sleep", address=address).returncode == 0
    refused = cli("generate", "hi", "--max-tokens", "2", address=address)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("tandem: UNAVAILABLE: the engines are asleep")
    assert "tandem admin wake" in refused.stderr
    assert cli("health", address=address).stdout == "NOT_SERVING\n"
    text = cli("info", address=address).stdout
    assert "every engine is asleep" in text and "connected, asleep" in text
    assert cli("admin", "wake", address=address).returncode == 0
    served = cli("generate", "hi", "--max-tokens", "2", "--ignore-eos", address=address)
    assert served.returncode == 0, served.stderr


def test_admin_drain_refuses_new_calls_on_this_frontend_until_resume(address):
    drained = cli("admin", "drain", "--wait", "0", address=address)
    assert (drained.returncode, drained.stdout) == (0, "drained\n"), drained.stderr
    refused = cli("generate", "hi", address=address)
    assert refused.stderr.startswith("tandem: UNAVAILABLE: the server is draining")
    assert cli("health", address=address).returncode == 1
    server = info_json(address)
    assert server["draining"] and not server["serving"]
    assert "state          draining" in cli("info", address=address).stdout
    assert cli("admin", "resume", address=address).returncode == 0
    assert cli("health", address=address).returncode == 0


def test_admin_profile_and_reset_prefix_cache_and_refusals(address, tmp_path):
    assert cli("admin", "reset-prefix-cache", address=address).returncode == 0
    stopped = cli("admin", "profile", "stop", address=address)  # none running: an engine's refusal
    assert stopped.returncode == 1
    assert stopped.stderr.startswith("tandem: admin profile did not complete: engine at ")
    assert "no profile is running" in stopped.stderr
    assert cli("admin", "profile", "start", "--output-dir", str(tmp_path / "trace"), address=address).returncode == 0
    assert cli("generate", "hi", "--max-tokens", "2", address=address).returncode == 0
    assert cli("admin", "profile", "stop", address=address).returncode == 0
    assert list((tmp_path / "trace").glob("*.trace.json"))  # the engine runs on this machine


def test_bad_admin_flags_are_refused_before_any_call(address):
    for args, message in ((("drain", "--wait", "-1"), "--wait must be >= 0"),
                          (("drain", "--wait", "500"), "shorter than --timeout"),
                          (("profile", "start"), "profile start needs --output-dir")):
        result = cli("admin", *args, address=address)
        assert result.returncode == 1 and result.stderr.startswith("tandem: INVALID_ARGUMENT: "), result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr
    bad_mode = cli("admin", "pause", "--mode", "freeze", address=address)
    assert bad_mode.returncode == 2 and "invalid choice: 'freeze'" in bad_mode.stderr
    assert cli("health", address=address).stdout == "SERVING\n"  # nothing reached the server


def test_admin_takes_the_admin_token_from_its_env_var_before_the_api_tokens(monkeypatch):
    monkeypatch.setenv("TANDEM_API_TOKEN", "api")
    args = build_parser().parse_args(["admin", "resume"])
    assert token_from_args(args) == "api"
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", "admin")
    assert token_from_args(args) == "admin"
    assert token_from_args(build_parser().parse_args(["info"])) == "api"  # other commands keep the API token


def test_the_python_clients_make_every_operator_call(address, tmp_path):
    with TandemClient(address, timeout=60) as client:
        assert client.pause("keep") == DONE
        (engine,) = client.server_info().engines
        assert engine.paused and not client.server_info().serving
        assert (client.health(), client.health("tandem.v1.AdminService")) == ("NOT_SERVING", "SERVING")
        assert client.resume() == DONE and client.health() == "SERVING"
        assert client.reset_prefix_cache() == DONE
        refused = client.stop_profile()
        assert not refused.ok and "no profile is running" in refused.detail
        with pytest.raises(ValueError, match="pause mode must be one of abort, wait, keep, got 'freeze'"):
            client.pause("freeze")
        with pytest.raises(TandemError) as bad:
            client.drain(-1)
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in bad.value.message

    async def run():
        async with AsyncTandemClient(address, timeout=60, retry=RetryPolicy(retries=0)) as ac:
            assert await ac.sleep() == DONE
            with pytest.raises(TandemError) as asleep:
                [chunk async for chunk in ac.generate("hi", max_tokens=2)]
            assert await ac.wake_up() == DONE
            drained = await ac.drain(0)
            with pytest.raises(TandemError) as draining:
                await ac.embed("hi")
            assert await ac.resume() == DONE
            started = await ac.start_profile(str(tmp_path / "trace"))
            return asleep.value, drained, draining.value, started, await ac.stop_profile(), await ac.health()

    asleep, drained, draining, started, stopped, health = run_async(run())
    assert asleep.code == draining.code == grpc.StatusCode.UNAVAILABLE
    assert "asleep" in asleep.message and "draining" in draining.message
    assert drained == AdminResult(True, "drained") and started == stopped == DONE and health == "SERVING"
