"""build_app takes Ray Serve LLM's LLMConfig shape as well as Shoal's flat ServerArgs: model_loading_config
maps to served_model_name / model_path / tokenizer_path, engine_kwargs (vLLM's names) are flattened and
translated as LLM(...)'s are, lora_config gives the on-demand loading keys, deployment_config and runtime_env
become the deployment's .options, and `llm_configs: [one]` is unwrapped. Before, the LLMConfig shape failed
with "--engine-kwargs: unknown server argument". Unknown keys are one error naming each by its YAML key."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("ray.serve")

from runtime.config import ServerArgs  # noqa: E402
from runtime.entrypoints.ray_serve import build_app, replica_args  # noqa: E402
from runtime.entrypoints.serve_app_args import ServeAppArgs, accelerator_split  # noqa: E402
from runtime.entrypoints.serve_lora import LoraLoading  # noqa: E402
from runtime.errors import ServerArgsError  # noqa: E402

LLM_CONFIG = {
    "model_loading_config": {"model_id": "qwen-0.5b", "model_source": "/models/Qwen2.5-0.5B-Instruct"},
    "engine_kwargs": {"tensor_parallel_size": 2, "max_model_len": "8k", "gpu_memory_utilization": 0.8,
                      "enable_lora": True, "max_lora_rank": 32, "max_num_seqs": 64},
    "lora_config": {"dynamic_lora_loading_path": "/adapters/", "max_num_adapters_per_replica": 8},
    "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4},
                          "max_ongoing_requests": 128, "ray_actor_options": {"num_cpus": 2, "num_gpus": 0}},
    "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}},
}


def test_llm_config_maps_onto_server_args_and_deployment_options():
    app = ServeAppArgs.of(LLM_CONFIG)
    server, loading = LoraLoading.split(app.kwargs)
    assert loading == LoraLoading("/adapters", 8)
    args = ServerArgs.from_kwargs(**server)  # what the replica builds
    assert (args.served_model_name, args.model_path) == ("qwen-0.5b", "/models/Qwen2.5-0.5B-Instruct")
    assert (args.tp_size, args.context_length, args.mem_fraction_static) == (2, 8000, 0.8)
    assert (args.enable_lora, args.max_lora_rank, args.max_running_requests) == (True, 32, 64)
    assert app.options == {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}, "max_ongoing_requests": 128,
                           "ray_actor_options": {"num_cpus": 2, "num_gpus": 0,
                                                 "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}}}}


def test_build_app_applies_deployment_config_and_unwraps_llm_configs():
    """build_openai_app's {"llm_configs": [one]} as well; the bound deployment carries deployment_config."""
    app = build_app({"llm_configs": [{**LLM_CONFIG, "deployment_config": {"num_replicas": 2,
                                                                          "graceful_shutdown_timeout_s": 60}}]})
    d = app._bound_deployment
    assert d.name == "ShoalDeployment" and d.num_replicas == 2
    assert d._deployment_config.graceful_shutdown_timeout_s == 60
    assert d.ray_actor_options["runtime_env"] == {"env_vars": {"HF_HUB_OFFLINE": "1"}}
    assert d.init_args[0]["served_model_name"] == "qwen-0.5b"
    # no model_source: model_id is the model (a Hub repo id, as Ray takes it); the replica's args build
    app = build_app({"model_loading_config": {"model_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}})
    kwargs = app._bound_deployment.init_args[0]
    assert kwargs == {"served_model_name": "HuggingFaceTB/SmolLM2-135M-Instruct",
                      "model_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert replica_args(kwargs).model_path == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_unknown_keys_are_one_error_naming_each_yaml_key():
    config = {"llm_configs": [{"model_loading_config": {"model_id": "m", "mirror": 1},
                               "engine_kwargs": {"max_model_len": 4096, "frobnicate": 1, "max_num_seqs": 8,
                                                 "dynamic_lora_loading_path": "/a"},
                               "deployment_config": {"user_config": {}},
                               "placement_group_config": {"bundles": [{"GPU": 1}], "gang": True},
                               "accelerator_kind": "L4"}],
              "ingress_deployment_config": {}}
    with pytest.raises(ServerArgsError) as e:
        build_app(config)
    keys = e.value.flag.split(", ")
    assert keys == ["ingress_deployment_config", "llm_configs[0].accelerator_kind",
                    "llm_configs[0].model_loading_config.mirror", "llm_configs[0].engine_kwargs.dynamic_lora_loading_path",
                    "llm_configs[0].deployment_config.user_config", "llm_configs[0].placement_group_config.gang",
                    "llm_configs[0].engine_kwargs.frobnicate"], keys
    assert "unknown keys in the app's args" in str(e.value) and "--" not in e.value.flag
    with pytest.raises(ServerArgsError) as e:  # Shoal's flat shape: every unknown one too, as written
        build_app({"model_path": "/m", "max_model_len": 512, "foo": 1, "bar": 2})
    assert e.value.flag == "foo, bar"


@pytest.mark.parametrize(("engine_kwargs", "flag", "detail"), [
    ({"tensor_parallel_size": 0}, "engine_kwargs.tensor_parallel_size", "must be positive"),
    ({"max_model_len": "lots"}, "engine_kwargs.max_model_len", "must be an integer"),
    ({"model": "/other"}, "engine_kwargs.model", "sets what model_loading_config.model_source sets"),
    ({"enable_lora": False}, "lora_config.dynamic_lora_loading_path", "enable_lora must not be false"),
])
def test_bad_values_name_the_yaml_key(engine_kwargs, flag, detail):
    config = {"model_loading_config": {"model_id": "m", "model_source": "/m"}, "engine_kwargs": engine_kwargs,
              "lora_config": {"dynamic_lora_loading_path": "/a"}}
    with pytest.raises(ServerArgsError, match=detail) as e:
        build_app(config)
    assert e.value.flag == flag


@pytest.mark.parametrize(("config", "flag", "detail"), [
    ({"llm_configs": []}, "llm_configs", "exactly one LLMConfig"),
    ({"llm_configs": [{"model_loading_config": {"model_id": "a"}}] * 2}, "llm_configs", "exactly one"),
    ({"engine_kwargs": {"max_model_len": 512}}, "model_loading_config.model_id", "is required"),
    ({"model_loading_config": {"model_id": "m", "model_source": {"bucket_uri": "s3://b/m"}}},
     "model_loading_config.model_source", "bucket mirror"),
    ({"model_loading_config": {"model_id": "m"}, "lora_config": {"dynamic_lora_loading_path": "s3://b/loras"}},
     "lora_config.dynamic_lora_loading_path", "not from a URI"),
    ({"model_loading_config": {"model_id": "m"}, "lora_config": {"max_num_adapters_per_replica": 0}},
     "lora_config.max_num_adapters_per_replica", "positive integer"),
    ({"model_loading_config": {"model_id": "m"}, "llm_engine": "SGLang"}, "llm_engine", "vLLM"),
    ({"model_loading_config": {"model_id": "m"}, "runtime_env": {"env_vars": {}},
      "deployment_config": {"ray_actor_options": {"runtime_env": {}}}}, "runtime_env", "give one of them"),
    ({"model_loading_config": {"model_id": "m"}, "accelerator_type": "GTX-1080"}, "accelerator_type",
     "not one of Ray's accelerator types: .*H100"),
    ({"model_loading_config": {"model_id": "m"}, "accelerator_type": "L4",
      "deployment_config": {"ray_actor_options": {"accelerator_type": "T4"}}}, "accelerator_type", "give one"),
    ({"model_loading_config": {"model_id": "m"}, "deployment_config": {"ray_actor_options": {"accelerator_type": "X1"}}},
     "deployment_config.ray_actor_options.accelerator_type", "not one of Ray's accelerator types"),
    ({"model_loading_config": {"model_id": "m"}, "placement_group_config": {"strategy": "RANDOM"}},
     "placement_group_config.strategy", "must be one of PACK, STRICT_PACK, SPREAD, STRICT_SPREAD"),
    ({"model_loading_config": {"model_id": "m"}, "engine_kwargs": {"placement": "pack"},
      "placement_group_config": {"strategy": "SPREAD"}}, "placement_group_config.strategy",
     "engine_kwargs.placement is 'pack'; give one"),
    ({"model_loading_config": {"model_id": "m"}, "placement_group_config": [{"GPU": 1}]}, "placement_group_config",
     "must be a mapping"),
])
def test_malformed_llm_configs_are_refused_by_key(config, flag, detail):
    with pytest.raises(ServerArgsError, match=detail) as e:
        build_app(config)
    assert e.value.flag == flag


def test_flat_args_keep_working_and_take_the_loading_path():
    app = build_app({"model_path": "/m", "tensor_parallel_size": 2, "dynamic_lora_loading_path": "/a"})
    kwargs = app._bound_deployment.init_args[0]
    server, loading = LoraLoading.split(kwargs)
    assert loading == LoraLoading("/a", 16) and server["enable_lora"] is True  # the path implies LoRA
    assert replica_args(server).tp_size == 2
    app = build_app(ServerArgs(model_path="/m"))  # a ServerArgs as is
    assert app._bound_deployment.init_args[0] == {f.name: getattr(ServerArgs(model_path="/m"), f.name)
                                                  for f in dataclasses.fields(ServerArgs)}


def test_accelerator_type_and_placement_group_config_as_ray_serve_llm_copies_carry_them(caplog):
    """Common in configs copied from Ray Serve LLM; before, both were "unknown keys". accelerator_type pins the
    replica to a node with that accelerator (Ray's `accelerator_type:<type>` resource); placement_group_config's
    strategy places the TP ranks, its bundles are said to be unused."""
    import logging

    config = {**LLM_CONFIG, "accelerator_type": "A10",  # Ray's LLMConfig reads A10 as A10G
              "placement_group_config": {"bundles": [{"GPU": 1, "CPU": 4}] * 2, "strategy": "STRICT_SPREAD"}}
    with caplog.at_level(logging.WARNING, logger="runtime.entrypoints.serve_app_args"):
        app = build_app(config)
    d = app._bound_deployment
    assert d.ray_actor_options["accelerator_type"] == "A10G" and d.ray_actor_options["num_cpus"] == 2
    server, accelerator = accelerator_split(LoraLoading.split(d.init_args[0])[0])
    assert replica_args(server).placement == "spread" and accelerator == "A10G"
    said = caplog.text
    assert "placement_group_config's bundles are not used" in said and "STRICT_SPREAD is taken as placement spread" in said
    assert "accelerator_type" not in said  # tp 2: the ranks' bundles ask for it too (test_serve_accelerator.py)
    caplog.clear()
    app = build_app({"model_loading_config": {"model_id": "m", "model_source": "/m"}, "accelerator_type": "L4",
                     "placement_group_config": {"bundle_per_worker": {"GPU": 1}}})
    d = app._bound_deployment
    assert d.ray_actor_options["accelerator_type"] == "L4" and "placement" not in d.init_args[0]
    assert "accelerator_type" not in caplog.text  # tp = dp = 1: the engine runs in the replica itself
    app = build_app({"model_path": "/m", "accelerator_type": "L4"})  # flat args take it too
    assert app._bound_deployment.ray_actor_options["accelerator_type"] == "L4"
