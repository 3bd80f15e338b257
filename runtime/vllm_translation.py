"""Translation: how runtime/vllm_flags.py's table of vLLM flags lands on ServerArgs' fields. A VllmFlag names
the flag, its value's kind and its treatment; a treatment sets fields (checked against what the user gave by
Shoal's own names), adds a note to log, or raises a ServerArgsError naming the flag."""

from __future__ import annotations

import logging
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.errors import ServerArgsError
from runtime.logging_setup import setup_logging
from runtime.server_flags import flag_name

logger = logging.getLogger("shoal.vllm_flags")  # the table's notes: one logger, whichever module logs them


class Translation:
    """The ServerArgs values some vLLM flags land on. A vLLM flag that contradicts a setting the user gave by
    Shoal's own name (or another vLLM flag) is an error naming both, never a silent winner."""

    def __init__(self, values: dict[str, Any], given: Mapping[str, str]):
        self.values = values  # every ServerArgs field, as given or defaulted
        self.given = given  # the fields the user set -> the spelling used
        self.changed: dict[str, tuple[Any, str]] = {}  # field -> (value, the vLLM flag that set it)
        self.notes: list[str] = []

    def get(self, name: str) -> Any:
        return self.values[name]

    def set(self, name: str, value: Any, flag: str) -> None:
        earlier = self.changed.get(name)
        if earlier is not None and earlier[0] != value:
            raise ServerArgsError(flag, f"contradicts {earlier[1]} (both set {flag_name(name)})")
        if name in self.given and self.values[name] != value:
            now = self.values[name]
            raise ServerArgsError(flag, f"contradicts {self.given[name]}{'' if isinstance(now, bool) else f' {now!r}'} "
                                        f"(it would set {flag_name(name)} to {value!r}); give one of them")
        self.values[name] = value
        self.changed[name] = (value, flag)

    def note(self, flag: str, value: Any, why: str) -> None:
        shown = flag if isinstance(value, bool) else f"{flag}{'' if flag == '-O' else ' '}{value}"  # -O3
        self.notes.append(f"vLLM's {shown}: {why}")


Treat = Callable[[Any, Translation, str], None]


@dataclass(frozen=True, slots=True)
class VllmFlag:
    names: tuple[str, ...]  # CLI spellings: the first names it in messages, the first long one is LLM()'s kwarg
    kind: str  # "bool" (--x / --no-x), "int", "float", "str", "list" (repeatable), "any" (checked by treat)
    treat: Treat

    @property
    def flag(self) -> str:
        return self.names[0]

    @property
    def key(self) -> str:
        return next(n for n in self.names if n.startswith("--")).removeprefix("--").replace("-", "_")

    def checked(self, value: Any) -> Any:
        """An LLM(...) kwarg's value, of the type the CLI would have parsed (a wrong one is refused by name)."""
        ok = {"bool": lambda v: isinstance(v, bool),
              "int": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
              "str": lambda v: isinstance(v, str)}.get(self.kind, lambda v: True)
        if not ok(value):
            raise ServerArgsError(self.flag, f"must be {'an' if self.kind == 'int' else 'a'} {self.kind}, got {value!r}")
        if self.kind == "list":  # the CLI's repeated flag; a kwarg may give one value
            return list(value) if isinstance(value, list | tuple) else [value]
        return value


def noop(why: str, unless: tuple[Any, ...] = (False,)) -> Treat:
    """(b): accepted, logged with what Shoal does instead; `unless` values (vLLM's default) say nothing."""
    def treat(value: Any, tr: Translation, flag: str) -> None:
        if value not in unless:
            tr.note(flag, value, why)
    return treat


def refuse(why: str, unless: tuple[Any, ...] = (False,)) -> Treat:
    """(c): a ServerArgsError naming the flag, except for `unless` values (what vLLM does by default)."""
    def treat(value: Any, tr: Translation, flag: str) -> None:
        if value not in unless:
            raise ServerArgsError(flag, why)
    return treat


def alias(name: str) -> Treat:
    return lambda value, tr, flag: tr.set(name, value, flag)


def at_least(low: float, then: Treat) -> Treat:
    def treat(value: Any, tr: Translation, flag: str) -> None:
        if not value >= low:  # NaN too
            raise ServerArgsError(flag, f"must be >= {low}, got {value}")
        then(value, tr, flag)
    return treat


def human_int(text: str, flag: str) -> int:
    """vLLM's human-readable integers (its human_readable_int): 8192, 8k = 8000, 25.6k = 25600 (k m g t
    decimal), 32K = 32768 (K M G T binary, whole numbers only)."""
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", value)
    if match is None:
        raise ServerArgsError(flag, f"must be an integer such as 8192, 8k (8000) or 8K (8192), got {text!r}")
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise ServerArgsError(flag, f"decimals are allowed with k, m, g, t (powers of 1000) only, got {text!r}")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1) if suffix else int(number)


def log_notes(notes: list[str], level: str) -> None:
    """Logs the accepted no-op flags once, at start. Shoal's logging is set up here: these lines come before
    the Engine or the server would set it up, and would otherwise be dropped."""
    if notes:
        setup_logging(level)
    for line in notes:
        logger.info("%s", line)
