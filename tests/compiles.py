"""Counting JAX compiles: a step that compiles again after warm-up costs seconds per request."""
from __future__ import annotations

import jax

COMPILE_EVENTS = ("/jax/core/compile/",)


class CompileCounter:
    """Counts JAX tracing, lowering and backend-compile events while active."""

    def __init__(self):
        self.events: list[str] = []
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name: str, _secs: float, **_kw) -> None:
        if self.active and name.startswith(COMPILE_EVENTS):
            self.events.append(name)
