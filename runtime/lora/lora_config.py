"""LoraSpec (one `name=path` of --lora-modules) and LoraAdapterConfig (a PEFT adapter_config.json, checked
for what Shoal serves). Errors name the flag and the field, before any weight loads."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import InvalidRequestError, ServerArgsError

FLAG = "--lora-modules"
# The projections an adapter may target; Shoal fuses q/k/v and gate/up (runtime/lora/lora_manager.py).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    name: str  # what requests name as `model` (or lora_name / lora_path)
    path: str


def parse_lora_modules(text: str | None) -> tuple[LoraSpec, ...]:
    """`name=path` items separated by spaces or commas (vLLM's --lora-modules, SGLang's --lora-paths);
    a bare path is named after its folder, as SGLang does."""
    specs: list[LoraSpec] = []
    for item in (text or "").replace(",", " ").split():
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).name, item
        if not _NAME.match(name) or not path:
            raise ServerArgsError(FLAG, f"{item!r} is not name=path (a name of letters, digits and ._:/-)")
        if any(s.name == name for s in specs):
            raise ServerArgsError(FLAG, f"adapter name {name!r} is given twice")
        specs.append(LoraSpec(name, path))
    return tuple(specs)


def runtime_spec(name: object, path: object) -> LoraSpec:
    """A load at run time's lora_name and lora_path, checked as --lora-modules checks its items."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(f"lora_name must be a name of letters, digits and ._:/- (starting with a letter "
                                  f"or digit), got {name!r}", param="lora_name")
    if not isinstance(path, str) or not path:
        raise InvalidRequestError("lora_path must name the adapter's folder", param="lora_path")
    return LoraSpec(name, path)


def lora_id_of(ids: dict[str, int], name: str | None, param: str = "model") -> int:
    """The id of adapter `name` (a LoraRegistry's map; None: 0, the base model); InvalidRequestError naming
    `param` if no such adapter is served."""
    if name is None:
        return 0
    lora_id = ids.get(name)  # one lookup: adapters are loaded and unloaded on other threads
    if lora_id is None:
        served = ", ".join(list(ids)) or "none; with --enable-lora, --lora-modules or /v1/load_lora_adapter add them"
        raise InvalidRequestError(f"no LoRA adapter {name!r} is served (adapters: {served})", param=param)
    return lora_id


class LoraNotFoundError(InvalidRequestError):
    """An unload of a name no adapter is served under (vLLM answers 404 NotFoundError)."""

    def __init__(self, name: str):
        super().__init__(f"The lora adapter '{name}' cannot be found.", param="lora_name", code="model_not_found")
        self.name = name

    def __reduce__(self):
        return type(self), (self.name,)


def load_error(e: ServerArgsError) -> InvalidRequestError:
    """A run-time load's refusal: the start-up check's words (rank, target modules, shapes, a missing file),
    naming the request's lora_path instead of the flag."""
    return InvalidRequestError(e.detail, param="lora_path")


def per_prompt(lora_name: str | list[str | None] | None, n: int) -> list[str | None]:
    """The Python API's lora_name (one for every prompt, or a list of one per prompt) as n names."""
    names = list(lora_name) if isinstance(lora_name, (list, tuple)) else [lora_name] * n
    if len(names) != n or not all(x is None or isinstance(x, str) for x in names):
        raise InvalidRequestError(f"lora_name must be a name or a list of {n} names (None: the base model), "
                                  f"got {lora_name!r}", param="lora_name")
    return names


@dataclass(frozen=True, slots=True)
class LoraAdapterConfig:
    name: str
    path: Path
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...]

    @classmethod
    def read(cls, spec: LoraSpec, max_rank: int) -> LoraAdapterConfig:
        path = Path(spec.path)
        where = f"adapter {spec.name!r} ({spec.path})"
        if not path.is_dir():
            raise ServerArgsError(FLAG, f"{where}: no such folder")
        cfg_file = path / "adapter_config.json"
        if not cfg_file.is_file():
            raise ServerArgsError(FLAG, f"{where}: no adapter_config.json (a PEFT LoRA folder is expected)")
        try:
            cfg: dict[str, Any] = json.loads(cfg_file.read_text())
        except ValueError as e:
            raise ServerArgsError(FLAG, f"{where}: adapter_config.json is not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ServerArgsError(FLAG, f"{where}: adapter_config.json is not a JSON object")
        if not (path / "adapter_model.safetensors").is_file():
            raise ServerArgsError(FLAG, f"{where}: no adapter_model.safetensors")

        def refuse(field: str, why: str) -> ServerArgsError:
            return ServerArgsError(FLAG, f"{where}: adapter_config.json {field}: {why}")

        if cfg.get("peft_type", "LORA") != "LORA":
            raise refuse("peft_type", f"{cfg.get('peft_type')!r} is not supported (only LORA)")
        if cfg.get("use_dora"):
            raise refuse("use_dora", "DoRA adapters are not supported")
        if cfg.get("modules_to_save"):
            raise refuse("modules_to_save", "fully trained modules (e.g. lm_head, embed_tokens) are not supported")
        if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
            raise refuse("bias", "LoRA bias terms are not supported (only bias: none)")
        for field in ("rank_pattern", "alpha_pattern", "layers_to_transform", "layer_replication"):
            if cfg.get(field):
                raise refuse(field, "per-module ranks, alphas and layer selections are not supported")
        if cfg.get("fan_in_fan_out"):
            raise refuse("fan_in_fan_out", "Conv1D-style (GPT-2) weights are not supported")
        rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise refuse("r", f"must be a positive integer, got {rank!r}")
        if rank > max_rank:
            raise refuse("r", f"rank {rank} is above --max-lora-rank {max_rank}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise refuse("lora_alpha", f"must be a number, got {alpha!r}")
        targets = cfg.get("target_modules") or ()
        if isinstance(targets, str):  # a regex or "all-linear": the tensors present decide (lora_adapter.py)
            targets = SUPPORTED_MODULES
        bad = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(SUPPORTED_MODULES))
        if bad:
            raise refuse("target_modules", f"{', '.join(bad)} not supported (LoRA on "
                                           f"{', '.join(SUPPORTED_MODULES)} only; no embedding or lm_head LoRA)")
        scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        return cls(spec.name, path, rank, float(scaling), tuple(t.rsplit(".", 1)[-1] for t in targets))
