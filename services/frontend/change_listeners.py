"""Callbacks run when an object's serving state may have changed (the frontend's health listens to them)."""

from __future__ import annotations

from collections.abc import Callable


class ChangeListeners:
    """A mixin: `add_listener` / `remove_listener` for callers, `_notify()` for the class that changed."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.remove(callback)

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()
