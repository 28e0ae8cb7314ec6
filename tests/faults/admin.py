"""Operator calls the fault tests use to freeze the shared engine (so counts cannot race)."""

from __future__ import annotations

import contextlib

import grpc
from tandem.v1 import admin_pb2, admin_pb2_grpc, common_pb2


def _admin(address: str, method: str, request):
    with grpc.insecure_channel(address) as channel:
        reply = getattr(admin_pb2_grpc.AdminServiceStub(channel), method)(request, timeout=30)
    assert reply.ok, f"{method}: {reply.detail}"
    return reply


def resume(address: str) -> None:
    _admin(address, "Resume", admin_pb2.ResumeRequest())


@contextlib.contextmanager
def frozen(address: str):
    """Pause the engine behind `address` with KEEP (nothing steps, nothing finishes); resume on exit."""
    _admin(address, "Pause", admin_pb2.PauseRequest(mode=common_pb2.PAUSE_MODE_KEEP))
    try:
        yield
    finally:
        resume(address)
