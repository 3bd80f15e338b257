"""`shoal serve --help` (issue 19, item 6): every flag with a default says it exactly once, and flags whose
default is described in words (None) or is off (switches) print no "(default: None/False)"."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from runtime.config import ServerArgs

REPO = Path(__file__).resolve().parents[2]


def _flag_blocks(help_text: str) -> dict[str, str]:
    """Each option's help, whitespace folded, keyed by its long flag."""
    blocks: dict[str, str] = {}
    flag = None
    for line in help_text.splitlines():
        m = re.match(r"\s{2}(--[\w-]+)", line)
        if m:
            flag = m.group(1)
            blocks[flag] = line
        elif flag is not None and line.startswith(" " * 6):
            blocks[flag] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in blocks.items()}


def test_serve_help_states_each_default_once():
    out = subprocess.run([sys.executable, "-m", "runtime", "serve", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=60, check=True).stdout
    blocks = _flag_blocks(out)
    assert blocks.pop("--version").startswith("--version")  # the one flag that is no ServerArgs field
    fields = dataclasses.fields(ServerArgs)
    assert len(blocks) == len(fields)
    for f in fields:
        text = blocks["--" + f.name.replace("_", "-")]
        shown = text.count("(default:")
        if f.default is None or f.type in ("bool", bool):
            assert shown == 0, text
        else:
            assert shown == 1 and f"(default: {f.default})" in text, text
    assert "(default: 30000)" in blocks["--port"]
