"""Engine addresses from `--engine` targets: plain `host:port`, or `dns:///name:port` resolved to every address.

A `dns:///` target names a Kubernetes headless Service (`dns:///tandem-engine.NAMESPACE.svc:50061`):
its name resolves to one address per ready engine pod, and the frontend opens one Connect stream
to each. `EngineDiscovery` resolves every DNS target on an interval and whenever `refresh()` is
called (the engine client calls it when a stream breaks), and hands the full set of addresses to
`on_change` whenever it differs. A name that fails to resolve keeps its last answer (a DNS hiccup
must not retire healthy engines); engines that are really gone also drop their streams.

The resolver is injectable: `Resolver.resolve(host, port)` returns "host:port" addresses, so tests
swap in one whose answer they change.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

DEFAULT_RESOLVE_INTERVAL_S = 10.0


@dataclass(frozen=True)
class EngineTarget:
    """One --engine value: a fixed address, or a DNS name to resolve (`dns` True)."""

    host: str
    port: int
    dns: bool = False

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def __str__(self) -> str:
        return f"dns:///{self.address}" if self.dns else self.address


def format_address(host: str, port: int) -> str:
    """host:port, with IPv6 literals in brackets."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    return f"{host}:{port}"


def parse_engine_target(text: str) -> EngineTarget:
    """`host:port`, `[v6]:port`, `dns:///host:port` or `dns:host:port`; ValueError naming the problem."""
    value = text.strip()
    dns = value.startswith("dns:")
    if dns:
        value = value.removeprefix("dns:")
        if value.startswith("//"):
            authority, _, value = value[2:].partition("/")
            if authority:
                raise ValueError(f"engine target {text!r}: a DNS server authority is not supported; "
                                 "use dns:///name:port (the system resolver)")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"engine target {text!r} is not host:port or dns:///name:port (e.g. 127.0.0.1:50061 or "
                         "dns:///tandem-engine.default.svc:50061)")
    return EngineTarget(host.removeprefix("[").removesuffix("]"), int(port), dns)


def parse_engine_targets(values: Iterable[str]) -> list[EngineTarget]:
    """Every --engine value, each maybe a comma-separated list."""
    return [parse_engine_target(part) for value in values for part in value.split(",") if part.strip()]


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> list[str]:
        """Every address behind `host` as "host:port"; raises OSError when the name does not resolve."""


class SystemResolver:
    """The system resolver (getaddrinfo on the event loop's executor), every A and AAAA record."""

    async def resolve(self, host: str, port: int) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return sorted({format_address(info[4][0], info[4][1]) for info in infos})


class EngineDiscovery:
    """The engine addresses behind the targets, kept current; `on_change(addresses)` on every change."""

    def __init__(self, targets: list[EngineTarget], on_change: Callable[[list[str]], None], *,
                 resolver: Resolver | None = None, interval_s: float = DEFAULT_RESOLVE_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"the resolve interval must be > 0 seconds, got {interval_s}")
        self.targets = targets
        self.resolver = resolver or SystemResolver()
        self.interval_s = interval_s
        self._on_change = on_change
        self._answers: dict[EngineTarget, list[str]] = {t: [t.address] for t in targets if not t.dns}
        self.addresses: list[str] = []
        self.names: dict[str, str] = {}  # address -> the DNS name it was resolved from
        self._refresh = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def dynamic(self) -> bool:
        return any(t.dns for t in self.targets)

    async def start(self) -> None:
        """Resolve once (so the first engines are known), then keep resolving in the background."""
        await self.resolve_now()
        if self.dynamic:
            self._task = asyncio.create_task(self._loop(), name="engine discovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def refresh(self) -> None:
        """Resolve again soon (an engine's stream broke: it may have moved or gone)."""
        self._refresh.set()

    async def resolve_now(self) -> list[str]:
        """Resolve every DNS target now; the addresses (on_change ran if they changed)."""
        for target in (t for t in self.targets if t.dns):
            try:
                answer = await self.resolver.resolve(target.host, target.port)
            except OSError as exc:
                log.warning("could not resolve engine target %s (%s); keeping its last %d address(es)",
                            target, exc, len(self._answers.get(target, [])))
                continue
            if answer != self._answers.get(target):
                log.info("engine target %s resolves to %s", target, ", ".join(answer) or "nothing")
            self._answers[target] = answer
            self.names.update(dict.fromkeys(answer, target.host))
        addresses = list(dict.fromkeys(a for t in self.targets for a in self._answers.get(t, [])))
        if addresses != self.addresses:
            self.addresses = addresses
            self._on_change(addresses)
        return addresses

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._refresh.wait(), self.interval_s)
            self._refresh.clear()
            try:
                await self.resolve_now()
            except Exception:  # a resolver bug must not end discovery
                log.exception("engine discovery failed; retrying in %.1fs", self.interval_s)
