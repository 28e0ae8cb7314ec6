"""Operator calls (tandem.v1.AdminService) as the clients make them, and the server states they leave.

Requests from keywords and results from responses, like clients/generation.py (the only other client
module that touches generated protos); TandemClient and AsyncTandemClient make the calls, `tandem admin`
prints PAUSE_MODES in its help and `tandem info` describes the states with the functions below.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.v1 import admin_pb2, common_pb2, generation_pb2

# What happens to requests in flight, per pause mode (tandem.v1.PauseMode); in every mode new requests wait
# until resume, and the frontends' readiness says NOT_SERVING meanwhile.
PAUSE_MODES = {
    "abort": (common_pb2.PAUSE_MODE_ABORT, "abort every request in flight (their streams end with finish reason "
                                           "abort), then pause"),
    "wait": (common_pb2.PAUSE_MODE_WAIT, "admit nothing new and let the running requests finish; the call "
                                         "returns once they have"),
    "keep": (common_pb2.PAUSE_MODE_KEEP, "freeze everything in place, requests in flight included; resume "
                                         "continues them where they stopped"),
}
_PAUSE_MODE_NAMES = {value: name for name, (value, _) in PAUSE_MODES.items()}


@dataclass(frozen=True)
class AdminResult:
    """An operator call's outcome: `ok` when every engine (or the frontend, for drain) did it; `detail` says
    what happened, or which engine refused and why (e.g. sleep while requests are in flight)."""

    ok: bool
    detail: str


def admin_request(method: str, **fields):
    """The request of AdminService/`method` (Pause, Resume, Sleep, WakeUp, ResetPrefixCache, StartProfile,
    StopProfile, Drain); Pause takes mode="abort" | "wait" | "keep"."""
    if "mode" in fields:
        fields["mode"] = pause_mode(fields["mode"])
    return getattr(admin_pb2, f"{method}Request")(**fields)


def pause_mode(name: str) -> int:
    try:
        return PAUSE_MODES[name.lower()][0]
    except (KeyError, AttributeError):
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {name!r}") from None


def admin_result(reply) -> AdminResult:
    return AdminResult(reply.ok, reply.detail)


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter as one engine holds it (tandem.v1.LoraAdapter)."""

    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    pinned: bool
    location: str  # device (a slot), host (host memory) or disk (read again when used)
    engine: str  # the engine's address, as the frontend knows it


def lora_adapters(reply) -> list[LoraAdapter]:
    """The adapters of a Load/List/PinLoraAdapter response, one per adapter and engine."""
    return [LoraAdapter(a.name, a.path, a.rank, a.alpha, tuple(a.target_modules), a.pinned, a.location, a.engine)
            for a in reply.adapters]


# ---- the states, as GetServerInfo reports them ----------------------------------------------------
def engine_state(engine: generation_pb2.EngineStatus) -> str:
    """"admitting", "paused (keep)", "asleep" or both, for one engine of GetServerInfo."""
    states = []
    if engine.paused:
        states.append(f"paused ({_PAUSE_MODE_NAMES.get(engine.pause_mode, 'abort')})")
    if engine.asleep:
        states.append("asleep")
    return ", ".join(states) or "admitting"


def server_state(server: generation_pb2.GetServerInfoResponse) -> str:
    """Whether new requests start on this frontend, and if not why and what ends it."""
    if server.draining:
        return "draining: new requests get UNAVAILABLE until `tandem admin resume`"
    if server.serving:
        return "serving"
    engines = [e for e in server.engines if e.connected]
    if not engines:
        return "not serving: no engine is connected"
    if all(e.asleep for e in engines):
        return "not serving: every engine is asleep; new requests get UNAVAILABLE until `tandem admin wake`"
    return "not serving: every engine is paused or asleep; new requests wait for `tandem admin resume`"
