"""remote_cause: the line naming why an actor died, out of the errors Ray raises (built here from Ray's
own exception classes: no cluster needed)."""

from __future__ import annotations

import pytest

ray_exceptions = pytest.importorskip("ray.exceptions")

from runtime.cluster.remote_error import remote_cause  # noqa: E402
from runtime.errors import ModelConfigError  # noqa: E402


def test_constructor_error_inside_actor_died_error():
    cause = ModelConfigError("no config.json in /models/missing")
    trace = ("Traceback (most recent call last):\n  File \"gateway_actor.py\", line 40, in __init__\n"
             "    self.client = create_ray_engine_client(args)\n"
             "runtime.errors.ModelConfigError: no config.json in /models/missing")
    task_error = ray_exceptions.RayTaskError("GatewayActor.__init__", trace, cause)
    died = ray_exceptions.ActorDiedError(task_error)
    assert remote_cause(died) == "ModelConfigError: no config.json in /models/missing"
    assert remote_cause(task_error.as_instanceof_cause()) == "ModelConfigError: no config.json in /models/missing"


def test_os_error_and_plain_text():
    assert remote_cause(RuntimeError("OSError: [Errno 98] address already in use")) == \
        "OSError: [Errno 98] address already in use"
    assert remote_cause(RuntimeError("\nsomething odd happened\nmore")) == "something odd happened"


def test_cause_without_a_message_and_ray_colours():
    text = ("The actor died because of an error raised in its creation task, \x1b[36mray::GatewayActor.__init__()"
            "\x1b[39m (pid=1)\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
            "runtime.errors.ModelConfigError")
    assert remote_cause(RuntimeError(text)) == "ModelConfigError"
    assert remote_cause(RuntimeError("Traceback:\nKeyboardInterrupt")) == "KeyboardInterrupt"
    assert "\x1b" not in remote_cause(RuntimeError("\x1b[36mray::A()\x1b[39m died"))
