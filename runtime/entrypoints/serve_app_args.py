"""ServeAppArgs: build_app's `args` (a Serve config's `args:` block) as the replica and the deployment take them.
Two shapes are accepted:

- Shoal's: ServerArgs fields, or vLLM's names of them as LLM(...) takes them (tensor_parallel_size,
  max_model_len, ...), plus the Serve-level dynamic_lora_loading_path and max_num_adapters_per_replica
  (serve_lora.py).
- Ray Serve LLM's LLMConfig, so a config written for `ray.serve.llm` runs with Shoal as the engine:
  model_loading_config (model_id → served_model_name; model_source → model_path, model_id where it has none, as
  Ray's; tokenizer_source → tokenizer_path), engine_kwargs (vLLM's engine arguments, flattened and translated
  as above: Shoal's own field names work there too), lora_config (dynamic_lora_loading_path,
  max_num_adapters_per_replica), deployment_config and runtime_env (the deployment's .options),
  accelerator_type (as Ray's: the replica's ray_actor_options.accelerator_type, and `accelerator_type:<type>`
  in every bundle of its TP/DP rank actors' placement groups, so no rank lands on another GPU; flat args
  take it too) and placement_group_config (its strategy as args.placement; its bundles are not used:
  Shoal reserves its TP ranks' own); or build_openai_app's {"llm_configs": [one]}.

Unknown keys are one error that lists each by its YAML key (engine_kwargs.foo, not --foo); other bad values
name the YAML key too where the error traces back to one."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.config import VLLM_ALIASES, ServerArgs
from runtime.entrypoints.serve_lora import MAX_KEY, PATH_KEY, LoraLoading
from runtime.errors import ServerArgsError
from runtime.vllm_flags import translate_vllm_kwargs

logger = logging.getLogger(__name__)

FIELDS = frozenset(f.name for f in dataclasses.fields(ServerArgs))
# An LLMConfig's keys; the first ones tell its shape from the flat one (flat args take accelerator_type too)
LLM_CONFIG_SHAPE = frozenset({"model_loading_config", "engine_kwargs", "lora_config", "deployment_config",
                              "runtime_env", "llm_engine", "log_engine_metrics"})
LLM_CONFIG_KEYS = LLM_CONFIG_SHAPE | {"accelerator_type", "placement_group_config"}
MODEL_LOADING = {"model_id": "served_model_name", "model_source": "model_path", "tokenizer_source": "tokenizer_path"}
LORA_CONFIG = {"dynamic_lora_loading_path": PATH_KEY, "max_num_adapters_per_replica": MAX_KEY}
LORA_NO_EFFECT = frozenset({"download_timeout_s", "max_download_tries"})  # Ray's bucket downloads
# placement_group_config's strategy → Shoal's placement of a replica's TP ranks (its own placement group)
PLACEMENT = {"PACK": "pack", "STRICT_PACK": "pack", "SPREAD": "spread", "STRICT_SPREAD": "spread"}
PLACEMENT_GROUP_KEYS = frozenset({"bundle_per_worker", "bundles", "strategy"})
# The replica's Serve-level key (split off by accelerator_split): its ranks' bundles ask for that accelerator.
ACCELERATOR_KEY = "accelerator_type"
# Serve's deployment options build_app can set (not name: the deployment is ShoalDeployment, as the config's
# `deployments:` names it; not user_config: ShoalDeployment has no reconfigure()).
DEPLOYMENT_OPTIONS = frozenset({"num_replicas", "autoscaling_config", "max_ongoing_requests", "max_queued_requests",
                                "ray_actor_options", "health_check_period_s", "health_check_timeout_s",
                                "graceful_shutdown_wait_loop_s", "graceful_shutdown_timeout_s", "logging_config",
                                "request_router_config", "placement_group_bundles", "placement_group_strategy",
                                "max_replicas_per_node"})
LIST_VALUED = ("allowed_origins", "metrics_compat")  # a YAML list, as vLLM's allowed_origins is
FLAT_HINT = ("each must be a ServerArgs field (`shoal serve --help`), a vLLM engine argument Shoal takes, "
             f"{PATH_KEY}, {MAX_KEY} or {ACCELERATOR_KEY}; or give Ray Serve LLM's LLMConfig shape "
             "(model_loading_config, engine_kwargs, ...)")
LLM_CONFIG_HINT = ("an LLMConfig here takes model_loading_config (model_id, model_source, tokenizer_source), "
                   "engine_kwargs (vLLM engine arguments Shoal takes, or ServerArgs fields), lora_config "
                   f"({', '.join(LORA_CONFIG)}), deployment_config (Serve deployment options: "
                   f"{', '.join(sorted(DEPLOYMENT_OPTIONS))}), runtime_env, accelerator_type, "
                   "placement_group_config (strategy), llm_engine and log_engine_metrics")


@dataclasses.dataclass(frozen=True)
class ServeAppArgs:
    kwargs: dict[str, Any]  # the replica's args: ServerArgs kwargs (vLLM's names too), serve_lora's keys and
    # ACCELERATOR_KEY
    options: dict[str, Any]  # ShoalDeployment.options(...): an LLMConfig's deployment_config and runtime_env
    names: dict[str, str]  # each kwargs key -> the YAML key it came from (what errors and warnings name)

    @classmethod
    def of(cls, args: Mapping[str, Any] | None) -> ServeAppArgs:
        """ServerArgsError naming the YAML key for anything the replica would refuse."""
        args = dict(args or {})
        if "llm_configs" in args:
            return cls._of_llm_configs(args)
        if LLM_CONFIG_SHAPE & args.keys():
            return cls._of_llm_config(args, "", [])
        kwargs, names = _joined_lists(args), {k: k for k in args}
        accelerator = kwargs.pop(ACCELERATOR_KEY, None)
        check(kwargs, names, FLAT_HINT)
        options: dict[str, Any] = {}
        _apply_accelerator_type(accelerator, options, kwargs, "")
        return cls(kwargs, options, names)

    @classmethod
    def _of_llm_configs(cls, args: dict[str, Any]) -> ServeAppArgs:
        """build_openai_app's args: one LLMConfig (a mapping, or a YAML file's path, as Ray takes it)."""
        configs = args["llm_configs"]
        if not isinstance(configs, list) or len(configs) != 1:
            got = f"{len(configs)} of them" if isinstance(configs, list) else repr(configs)
            raise ServerArgsError("llm_configs", f"a Shoal app serves one model: give exactly one LLMConfig "
                                                 f"(got {got}); deploy one app per model")
        config = configs[0]
        if isinstance(config, str):
            import yaml

            try:
                config = yaml.safe_load(Path(config).read_text())
            except (OSError, yaml.YAMLError) as e:
                raise ServerArgsError("llm_configs[0]", f"cannot read the LLMConfig file {configs[0]!r}: {e}") from None
        if not isinstance(config, Mapping):
            raise ServerArgsError("llm_configs[0]", f"must be an LLMConfig mapping or a YAML file's path, got {config!r}")
        # Ray's other build_openai_app args (ingress_deployment_config, ...) configure an ingress Shoal has none of.
        return cls._of_llm_config(config, "llm_configs[0].", [k for k in args if k != "llm_configs"])

    @classmethod
    def _of_llm_config(cls, config: Mapping[str, Any], at: str, unknown: list[str]) -> ServeAppArgs:
        unknown = unknown + [at + k for k in config if k not in LLM_CONFIG_KEYS]
        kwargs: dict[str, Any] = {}
        names: dict[str, str] = {}
        loading = _mapping(config, "model_loading_config", at)
        unknown += [f"{at}model_loading_config.{k}" for k in loading if k not in MODEL_LOADING]
        if not isinstance(loading.get("model_id"), str):
            raise ServerArgsError(f"{at}model_loading_config.model_id", "is required: the name requests give as "
                                                                        "`model` (a string)")
        source = loading.get("model_source")
        if source is not None and not isinstance(source, str):
            raise ServerArgsError(f"{at}model_loading_config.model_source", "must be a model folder or a Hugging "
                                  "Face repo id (a bucket mirror config is not supported: sync it to a folder)")
        for key, field in MODEL_LOADING.items():
            if loading.get(key) is not None:
                kwargs[field], names[field] = loading[key], f"{at}model_loading_config.{key}"
        if source is None:  # Ray's default: model_id is the Hugging Face repo id
            kwargs["model_path"], names["model_path"] = loading["model_id"], f"{at}model_loading_config.model_id"
        engine = _mapping(config, "engine_kwargs", at)
        for key, value in engine.items():
            if key in LORA_CONFIG.values():  # Serve-level: lora_config's
                unknown.append(f"{at}engine_kwargs.{key}")
                continue
            _check_not_given_twice(key, names, f"{at}engine_kwargs.{key}")
            kwargs[key], names[key] = value, f"{at}engine_kwargs.{key}"
        lora = _mapping(config, "lora_config", at)
        for key, value in lora.items():
            if key in LORA_CONFIG:
                kwargs[LORA_CONFIG[key]], names[LORA_CONFIG[key]] = value, f"{at}lora_config.{key}"
            elif key in LORA_NO_EFFECT:
                logger.warning("ray_serve: %slora_config.%s has no effect: Shoal loads adapters from a folder, "
                               "with nothing to download", at, key)
            else:
                unknown.append(f"{at}lora_config.{key}")
        options = dict(_mapping(config, "deployment_config", at))
        unknown += [f"{at}deployment_config.{k}" for k in options if k not in DEPLOYMENT_OPTIONS]
        unknown += _apply_placement_group(config, kwargs, names, at)
        kwargs = _joined_lists(kwargs)
        check(kwargs, names, LLM_CONFIG_HINT, unknown)
        _apply_runtime_env(config, options, at)
        _apply_accelerator_type(config.get("accelerator_type"), options, kwargs, at)
        engine_name = config.get("llm_engine", "vLLM")
        if str(engine_name).lower() != "vllm":
            raise ServerArgsError(f"{at}llm_engine", f"Shoal runs the model; its engine_kwargs take vLLM's names "
                                                     f"(llm_engine: vLLM), not {engine_name!r}")
        if "log_engine_metrics" in config:
            logger.warning("ray_serve: %slog_engine_metrics has no effect: each replica's /metrics always "
                           "carries the engine's series", at)
        return cls(kwargs, options, names)


def check(kwargs: Mapping[str, Any], names: Mapping[str, str], hint: str,
          unknown: list[str] | None = None) -> ServerArgs:
    """What the replica's ServerArgs.from_kwargs does (vLLM's names translated, then ServerArgs built), with
    every unknown key listed at once (those found before too) and errors named by YAML key."""
    unknown = list(unknown or ())
    try:
        server, _ = LoraLoading.split(kwargs, names)
        translated = translate_vllm_kwargs(server)  # passes an unknown key through as it is: found next
    except ServerArgsError as e:
        if unknown:  # the unknown keys first: a value error may well come from a key misplaced
            raise unknown_keys(unknown, hint) from None
        raise renamed(e, names) from None
    unknown += [names.get(k, k) for k in translated if k not in FIELDS]
    if unknown:
        raise unknown_keys(unknown, hint)
    try:
        return ServerArgs(**translated)
    except ServerArgsError as e:
        raise renamed(e, names) from None


def unknown_keys(keys: list[str], hint: str) -> ServerArgsError:
    plural = "s" if len(keys) > 1 else ""
    return ServerArgsError(", ".join(keys), f"unknown key{plural} in the app's args: {hint}")


def renamed(error: ServerArgsError, names: Mapping[str, str]) -> ServerArgsError:
    """error with its CLI flag (--max-model-len) replaced by the YAML key the value came from, where one did."""
    if not error.flag.startswith("--"):
        return error
    key = error.flag[2:].replace("-", "_")
    if key in names:
        return ServerArgsError(names[key], error.detail)
    for field in FIELDS:
        spellings = _spellings(field)
        given = [names[k] for k in sorted(spellings) if k in names]
        if key in spellings and len(given) == 1:
            return ServerArgsError(given[0], error.detail)
    return error


def _spellings(field: str) -> set[str]:
    """The kwargs names of a ServerArgs field: its own, and vLLM's long flags for it (--model: model)."""
    return {field, *(s[2:].replace("-", "_") for s in VLLM_ALIASES.get(field, ()) if s.startswith("--"))}


def _check_not_given_twice(key: str, names: Mapping[str, str], where: str) -> None:
    """An engine_kwargs key that sets what model_loading_config set (engine_kwargs.model beside model_source)."""
    for field in MODEL_LOADING.values():
        if field in names and key in _spellings(field):
            raise ServerArgsError(where, f"sets what {names[field]} sets; give one of them")


def _mapping(config: Mapping[str, Any], key: str, at: str) -> Mapping[str, Any]:
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ServerArgsError(at + key, f"must be a mapping, got {value!r}")
    return value


def _apply_runtime_env(config: Mapping[str, Any], options: dict[str, Any], at: str) -> None:
    """LLMConfig's runtime_env is the replica's, as Ray applies it: into ray_actor_options."""
    env = config.get("runtime_env")
    if env is None:
        return
    if not isinstance(env, Mapping):
        raise ServerArgsError(f"{at}runtime_env", f"must be a mapping, got {env!r}")
    actor = options.get("ray_actor_options") or {}
    if not isinstance(actor, Mapping):
        return  # Serve's .options names the bad ray_actor_options itself
    if actor.get("runtime_env") is not None:
        raise ServerArgsError(f"{at}runtime_env", f"{at}deployment_config.ray_actor_options.runtime_env sets "
                                                  "it too; give one of them")
    options["ray_actor_options"] = {**actor, "runtime_env": dict(env)}


def _apply_accelerator_type(value: Any, options: dict[str, Any], kwargs: dict[str, Any], at: str) -> None:
    """accelerator_type, as Ray Serve LLM applies it: the replica's ray_actor_options.accelerator_type (its
    node), and kwargs[ACCELERATOR_KEY], by which the replica's TP/DP rank actors' bundles each ask for
    `accelerator_type:<type>` (engine_factory.create_engine_client). deployment_config's
    ray_actor_options.accelerator_type alone does both too: a rank on another GPU type than its replica's
    would be a slower (or too small) replica that nothing reports."""
    actor = options.get("ray_actor_options") or {}
    if not isinstance(actor, Mapping):
        return  # Serve's .options names the bad ray_actor_options itself
    here = f"{at}deployment_config.ray_actor_options.accelerator_type"
    given = {where: _accelerator(v, where) for where, v in ((f"{at}accelerator_type", value),
                                                            (here, actor.get("accelerator_type"))) if v is not None}
    if len(set(given.values())) > 1:
        raise ServerArgsError(f"{at}accelerator_type", f"{here} is {actor['accelerator_type']!r}; give one of them")
    if given:
        value = next(iter(given.values()))
        options["ray_actor_options"] = {**actor, "accelerator_type": value}
        kwargs[ACCELERATOR_KEY] = value


def _accelerator(value: Any, where: str) -> str:
    """One of Ray's accelerator types (the names its nodes' `accelerator_type:<type>` resources carry)."""
    from ray.util.accelerators import accelerators

    known = sorted({v for k, v in vars(accelerators).items() if k.isupper() and isinstance(v, str)})
    value = "A10G" if value == "A10" else value  # as Ray's LLMConfig reads it
    if value not in known:
        raise ServerArgsError(where, f"{value!r} is not one of Ray's accelerator types: {', '.join(known)}")
    return value


def accelerator_split(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """(the rest, the accelerator type its ranks' bundles ask for) of a replica's args."""
    rest = dict(kwargs)
    return rest, rest.pop(ACCELERATOR_KEY, None)


def _apply_placement_group(config: Mapping[str, Any], kwargs: dict[str, Any], names: dict[str, str],
                           at: str) -> list[str]:
    """LLMConfig's placement_group_config (its unknown keys): Shoal places a replica's TP ranks itself, one
    {CPU: 1, GPU: 1} bundle each, so only the strategy carries over, as args.placement."""
    group = _mapping(config, "placement_group_config", at)
    where = f"{at}placement_group_config"
    if "strategy" in group:
        strategy = group["strategy"]
        if not isinstance(strategy, str) or strategy not in PLACEMENT:
            raise ServerArgsError(f"{where}.strategy", f"must be one of {', '.join(PLACEMENT)}, got {strategy!r}")
        if kwargs.get("placement", PLACEMENT[strategy]) != PLACEMENT[strategy]:
            raise ServerArgsError(f"{where}.strategy", f"{names['placement']} is {kwargs['placement']!r}; "
                                                       "give one of them")
        kwargs["placement"], names["placement"] = PLACEMENT[strategy], f"{where}.strategy"
        if strategy.startswith("STRICT_"):
            logger.warning("ray_serve: %s.strategy %s is taken as placement %s: Shoal's TP ranks are placed as "
                           "Ray's %s places them, as far as the cluster allows (not strictly)", where, strategy,
                           PLACEMENT[strategy], strategy.removeprefix("STRICT_"))
    if group.keys() & {"bundles", "bundle_per_worker"}:
        logger.warning("ray_serve: %s's bundles are not used: Shoal reserves one {CPU: 1, GPU: 1} bundle per TP "
                       "rank itself (tp > 1, dp > 1 or use_ray); the replica's own resources are "
                       "deployment_config.ray_actor_options'", where)
    return [f"{where}.{k}" for k in group if k not in PLACEMENT_GROUP_KEYS]


def _joined_lists(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(kwargs)
    for name in LIST_VALUED:
        if isinstance(out.get(name), list):
            out[name] = ",".join(map(str, out[name]))
    return out
