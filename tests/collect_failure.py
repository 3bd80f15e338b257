"""A batch in flight that fails as a pause collects it (overlap scheduling): shared by the pause and the failed-step
order tests."""

from __future__ import annotations

from typing import Any

import pytest


def fail_the_collect_a_pause_makes(monkeypatch: pytest.MonkeyPatch, scheduler: Any) -> None:
    """The next pause that finds a batch in flight (scheduler.pending) fails collecting it with "device error in
    flight"; a pause that finds none (between two steps) pauses as usual."""
    worker, finish, armed = scheduler.worker, scheduler.worker.finish_batch, []

    def failing(launched: Any) -> Any:
        if armed:
            armed.clear()
            raise RuntimeError("device error in flight")
        return finish(launched)

    pause_now = scheduler.pause_now

    def arm_then_pause(mode: str) -> int:
        if scheduler.pending is not None:
            armed.append(True)
        return pause_now(mode)

    monkeypatch.setattr(worker, "finish_batch", failing)
    monkeypatch.setattr(scheduler, "pause_now", arm_then_pause)
