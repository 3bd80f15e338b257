"""check_lora_flags: ServerArgs' LoRA flags checked together at start (runtime/config.py calls it), so a bad
adapter list or a combination LoRA does not run with fails before any weights load."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.errors import ServerArgsError
from runtime.lora.lora_config import parse_lora_modules

if TYPE_CHECKING:
    from runtime.config import ServerArgs


def check_lora_flags(args: ServerArgs) -> None:
    if args.max_loras < 1 or args.max_lora_rank < 1:
        raise ServerArgsError("--max-loras" if args.max_loras < 1 else "--max-lora-rank", "must be positive")
    if not args.enable_lora:
        if args.lora_modules:
            raise ServerArgsError("--lora-modules", "needs --enable-lora")
        return
    parse_lora_modules(args.lora_modules)  # a malformed list fails here, before anything loads
    for name, on in (("--speculative-algorithm", args.speculative_algorithm),
                     ("--enable-dp-attention", args.enable_dp_attention), ("--is-embedding", args.is_embedding)):
        if on:
            raise ServerArgsError("--enable-lora", f"does not run with {name} yet")
