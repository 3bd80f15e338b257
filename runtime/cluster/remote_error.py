"""remote_cause: the one line that says why a Ray actor died, out of the error Ray hands the caller.

An actor whose constructor raises dies, and every later call on it raises ActorDiedError. That keeps the
constructor's exception only as text: the remote traceback, ending in "ModelConfigError: no config.json
in /models/x". That last line is what the user needs, not a 100-line traceback."""

from __future__ import annotations

import re

# "runtime.errors.ModelConfigError: no config.json ...", "OSError: [Errno 98] ..." or a bare
# "KeyboardInterrupt", alone on its line as a traceback ends
_EXC_LINE = re.compile(r"^\s*(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit))(?:: (.*))?$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the actor's name in its messages


def remote_cause(exc: BaseException) -> str:
    """'ExcType: message' of the innermost exception the error's text names, or the text's first line."""
    text = _ANSI.sub("", str(exc))
    found = [m for m in map(_EXC_LINE.match, text.splitlines()) if m is not None]
    # Ray's own wrappers (RayTaskError, ActorDiedError) come first; the cause's line is the last one.
    inner = [m for m in found if not m[1].startswith(("Ray", "ActorDied"))]
    if inner:
        name, message = inner[-1][1], (inner[-1][2] or "").strip()
        return f"{name}: {message}" if message else name
    return next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
