"""ServerArgs: every knob of a Shoal server, built once (from the CLI or kwargs), validated, frozen."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import ServerArgsError
from runtime.fp8_flags import check_fp8_flags
from runtime.hf_cache import check_revisions
from runtime.http_flags import check_http_flags, normalize_http_flags
from runtime.lora.lora_flags import check_lora_flags
from runtime.priority_flags import check_priority_flags
from runtime.sampling.generation_defaults import check_flags as check_generation_flags
from runtime.server_flags import (  # noqa: F401  (METRICS_COMPAT, VLLM_ALIASES: still importable from here)
    METRICS_COMPAT,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    VLLM_ALIASES,
    FlagPlacement,
    add_server_flags,
    check_field_types,
    check_speculative_flags,
    pooler_config,
    served_model_aliases,
)
from runtime.server_flags import flag_name as _flag
from runtime.server_flags import hf_overrides as _hf_overrides
from runtime.server_flags import metrics_compat as _metrics_compat
from runtime.text.chat_template import read_chat_template
from runtime.vllm_flags import translate_vllm_kwargs


def _opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True, slots=True)
class ServerArgs:
    # Model
    model_path: str | None = _opt(None, "HF model folder (config.json + safetensors); default: embedded SmolLM2-135M-Instruct")
    revision: str | None = _opt(None, "a Hub repo id's branch, tag or commit in the local HF cache (default main)")
    tokenizer_path: str | None = _opt(None, "tokenizer folder (or cached Hub repo id); default: the model folder")
    tokenizer_revision: str | None = _opt(None, "--tokenizer-path's revision, as --revision is the model's")
    served_model_name: str | None = _opt(None, "model name reported by the API (vLLM's `--served-model-name a b c` "
                                               "serves b and c too: --served-model-aliases); default: the model "
                                               "folder name")
    served_model_aliases: tuple[str, ...] | None = _opt(None, "more names a request's `model` may give (listed by "
                                                              "/v1/models); responses and metrics carry "
                                                              "--served-model-name")
    chat_template: str | None = _opt(None, "Jinja chat template (or a file holding one) used instead of the tokenizer's")
    dtype: str = _opt("auto", "weight and activation dtype", ("auto", "float32", "bfloat16", "float16"))
    load_format: str = _opt("auto", "auto/safetensors read the checkpoint; dummy makes random weights", ("auto", "safetensors", "dummy"))
    context_length: int | None = _opt(None, "max tokens of prompt + output; default: the model's max_position_embeddings")
    device: str = _opt("auto", "auto picks cuda when available", ("auto", "cpu", "cuda"))
    random_seed: int = _opt(0, "seed for dummy weights and for requests without a seed")
    is_embedding: bool = _opt(False, "serve the model as an embedding model (vLLM's --task embed / --runner "
                                     "pooling): POST /v1/embeddings and Engine.encode(); pooling (last token, "
                                     "mean, CLS; normalized or not) from sentence-transformers' modules.json and "
                                     "1_Pooling/config.json, else last token + L2 norm (--pooler-config wins "
                                     "over both); generation answers 400")
    hf_overrides: str | None = _opt(None, "a JSON object merged over the checkpoint's config.json before it is read, "
                                          "as vLLM's flag: '{\"is_causal\": true}' (gte-Qwen2-1.5B-instruct), "
                                          "'{\"max_position_embeddings\": 32768}', rope_scaling, ...; "
                                          "Engine(hf_overrides={...}) takes a dict")
    pooler_config: str | None = _opt(None, "--is-embedding: vLLM's PoolerConfig as a JSON object, over what the "
                                           "model folder says: '{\"pooling_type\": \"MEAN\", \"normalize\": "
                                           "false}'; pooling_type LAST/MEAN/CLS, normalize, dimensions (default "
                                           "Matryoshka size), use_activation (classifiers' probs)")
    quantization: str | None = _opt(None, "fp8: quantize a bf16/fp16 checkpoint's linear weights to FP8 at load "
                                          "(per-channel); FP8 and 4-bit (AWQ, GPTQ, compressed-tensors W4A16) "
                                          "checkpoints are detected from config.json (naming them must match it)",
                                    ("fp8", "awq", "gptq", "compressed-tensors", "awq_marlin", "gptq_marlin"))
    fp8_weight_scales: str = _opt("act_weighted", "--quantization fp8: per-channel weight scales of least e4m3 "
                                                  "rounding error weighed by a calibration prefill's activations "
                                                  "(act_weighted), unweighted (mse), or amax / 448 (amax)",
                                  ("act_weighted", "mse", "amax"))
    fp8_weight_only: bool = _opt(False, "FP8 weights: never quantize activations (w8a16 at every batch size; more "
                                        "accurate, slower above 16 tokens a step, which then skip the FP8 GEMM)")
    fp8_act_terms: int = _opt(1, "FP8 weights on the w8a8 path: activations as one e4m3 term per token (1) or two "
                                 "(2: the first rounding's residual rounded again, the GEMM over twice the rows with "
                                 "the weight read once; w8a16's accuracy)", (1, 2))
    fp8_lm_head: bool = _opt(False, "FP8 weights: the LM head in FP8 too (the default with FP8 weights; this flag "
                                    "only makes it explicit, and refuses to start without FP8 weights)")
    disable_fp8_lm_head: bool = _opt(False, "FP8 weights: keep the LM head 16-bit. By default (CUDA sm89+) it also "
                                            "gets FP8 rows (~0.5 GB for an 8B's head) for the calls the w8a16 GEMV "
                                            "serves (1-2 rows, 1-16 with --fp8-weight-only), where its read halves "
                                            "(~0.19 ms of an 8B batch-1 step) and each chunk's leading logits are "
                                            "recomputed from the 16-bit rows (same greedy agreement as the 16-bit "
                                            "head, benchmarks/README.md)")
    # Memory and batching
    kv_cache_dtype: str = _opt("auto", "KV cache storage: auto = the model dtype; fp8_e4m3 halves the bytes per token",
                               ("auto", "fp8_e4m3"))
    kv_cache_scale: float | None = _opt(None, "fp8_e4m3 KV cache: one static scale for every layer's K and V "
                                              "(stored = x / scale); implies --kv-cache-scale-mode static")
    kv_cache_scale_mode: str = _opt("auto", "fp8_e4m3 KV cache scales, per layer: checkpoint (its k_scale/v_scale "
                                            "tensors), calibrate (one prefill at start, amax x 4 / 448), static "
                                            "(--kv-cache-scale, default 1.0); auto: --kv-cache-scale if given, "
                                            "else checkpoint if it has them, else calibrate",
                                    ("auto", "checkpoint", "calibrate", "static"))
    kv_cache_rotation: str = _opt("auto", "fp8_e4m3 KV cache: an exact change of basis of each head's q/k (and "
                                          "v) before K/V are rounded, so q.k loses less to e4m3's 3-bit "
                                          "mantissa: calibrated (per layer and head, from the calibration "
                                          "prefill), hadamard (fixed), none; auto: calibrated when the scales "
                                          "are calibrated (not with a checkpoint's k_scale/v_scale)",
                                  ("auto", "none", "hadamard", "calibrated"))
    max_total_tokens: int | None = _opt(None, "KV pool size in tokens (CPU default 16384; GPU: from --mem-fraction-static)")
    mem_fraction_static: float = _opt(0.85, "fraction of GPU memory for weights + KV pool")
    max_running_requests: int = _opt(256, "most requests decoding at once")
    max_prefill_tokens: int = _opt(16384, "token budget of one prefill batch")
    chunked_prefill_size: int = _opt(8192, "split prompts longer than this across steps; -1 disables")
    enable_mixed_chunk: bool = _opt(False, "run a prefill chunk and the running decodes in one MIXED forward")
    schedule_policy: str = _opt("lpm", "waiting-queue order (lpm needs the radix cache; lof: longest output first)",
                                ("fcfs", "lpm", "lof"))
    disable_radix_cache: bool = _opt(False, "turn the RadixAttention prefix cache off")
    init_new_token_ratio: float = _opt(0.7, "initial estimate of the share of max_new_tokens a request still needs")
    min_new_token_ratio: float = _opt(0.1, "floor of that estimate")
    new_token_ratio_decay: float = _opt(0.001, "per-step decay of the estimate")
    retract_ratio_growth: float = _opt(1.0, "after a retraction the estimate's floor rises to this many times "
                                       "the estimate that over-admitted (decaying 10x slower); 1: off (Shoal's own)")
    reserve_known_output: str = _opt("auto", "a request only max_new_tokens can end (ignore_eos, no stop ids, strings "
                                     "or grammar) reserves KV for its whole output at admission, and is retracted "
                                     "only after every request that estimates its need; auto: on a GPU",
                                     ("auto", "on", "off"))
    # Request priorities (runtime/managers/priority.py): SGLang's flags, and vLLM's --scheduling-policy priority
    enable_priority_scheduling: bool = _opt(False, "honour each request's integer `priority` (default 0): the queue goes "
                                            "by priority first (--schedule-policy's order within one), and a request "
                                            "that cannot start for lack of KV or of a running slot retracts running "
                                            "requests of lower priority; without it a non-zero priority is a 400")
    schedule_low_priority_values_first: bool = _opt(False, "priority: a lower value is served first (vLLM's way)")
    priority_scheduling_preemption_threshold: int | None = _opt(None, "a waiting request retracts a running one only if "
                                                                      "its priority is better by more than this (10; "
                                                                      "0 with --scheduling-policy priority)")
    scheduling_policy: str = _opt("fcfs", "vLLM's flag: priority = --enable-priority-scheduling with lower values "
                                          "first and any better priority preempting (vLLM's meaning)",
                                  ("fcfs", "priority"))
    # Execution
    attention_backend: str = _opt("auto", "attention backend", ("auto", "torch_native", "triton", "flashinfer"))
    disable_cuda_graph: bool = _opt(False, "never capture CUDA graphs")
    cuda_graph_max_bs: int = _opt(512, "largest decode batch captured in a CUDA graph (never more than "
                                       "--max-running-requests)")
    disable_overlap_schedule: bool = _opt(False, "prepare the next batch only after the current one finishes")
    watchdog_timeout: float | None = _opt(300.0, "a scheduler step (forward, collect) running longer than this many "
                                                 "seconds is a hang: the engine turns unhealthy (GET /health 503) "
                                                 "and the threads' stacks are logged; <= 0 or inf turns it off")
    # Speculative decoding (runtime/speculative): drafts checked by one TARGET_VERIFY forward per step
    speculative_algorithm: str | None = _opt(None, "NGRAM: drafts from the request's own prompt and output; "
                                                   "STANDALONE: a small draft model", ("NGRAM", "STANDALONE"))
    speculative_draft_model_path: str | None = _opt(None, "draft model folder for STANDALONE (same vocabulary)")
    speculative_num_draft_tokens: int = _opt(4, "draft tokens checked per request per step (K)")
    speculative_ngram_min_match_window_size: int = _opt(1, "NGRAM: shortest suffix matched in the request's tokens")
    speculative_ngram_max_match_window_size: int = _opt(4, "NGRAM: longest suffix matched (tried first)")
    # Sampling defaults (runtime/sampling/generation_defaults.py): what a request leaves unset, as vLLM and SGLang fill it
    generation_config: str = _opt("auto", "defaults of a request's unset temperature, top_p, top_k, min_p, "
                                          "repetition_penalty and max_tokens (max_new_tokens): auto = the model "
                                          "folder's generation_config.json, vllm = none, or a folder holding one "
                                          "(else its config.json)")
    override_generation_config: str | None = _opt(None, "a JSON object over those defaults (vLLM's): "
                                                        "'{\"temperature\": 0.5}'; its max_new_tokens also caps "
                                                        "a request's own max_tokens")
    sampling_defaults: str = _opt("model", "SGLang's: model (= --generation-config auto) or openai (= vllm)",
                                  ("model", "openai"))
    # Structured output, tools, reasoning
    grammar_compile_timeout_s: float = _opt(10.0, "a request whose grammar (JSON schema, regex, EBNF, tool "
                                                  "schemas) takes longer to compile gets a 400")
    tool_call_parser: str | None = _opt(None, "the model's tool-call format for tool_choice auto: llama3_json, hermes "
                                              "(Qwen2.5/Qwen3), mistral, qwen3_coder or pythonic (Llama 3.2/4)")
    reasoning_parser: str | None = _opt(None, "reasoning into reasoning_content: qwen3, deepseek-r1, mistral")
    # LoRA adapters (runtime/lora): requests pick one by `model` (or lora_name / lora_path)
    enable_lora: bool = _opt(False, "serve PEFT LoRA adapters of the base model beside it")
    lora_modules: str | None = _opt(None, "the adapters, name=path ... (a PEFT folder: adapter_config.json + "
                                          "adapter_model.safetensors); requests name them as `model`")
    max_loras: int = _opt(4, "adapter slots on the device: a batch mixes at most this many adapters (requests "
                             "of another wait until a slot's adapter has no request running)")
    max_lora_rank: int = _opt(16, "largest adapter rank r accepted (vLLM's default); the LoRA buffers of every "
                                  "projection and slot are this wide, so a larger one costs memory and step time")
    # Parallelism and Ray
    tp_size: int = _opt(1, "tensor-parallel ranks per replica")
    dp_size: int = _opt(1, "data-parallel replicas")
    enable_dp_attention: bool = _opt(False, "attention data-parallel, MLP tensor-parallel across all DP ranks")
    disable_custom_all_reduce: bool = _opt(False, "NCCL for every TP all-reduce (no symmetric-memory one-shot "
                                                  "for the small ones inside CUDA graphs)")
    step_channel: str = _opt("auto", "how TP rank 0 hands each step to the other ranks of its replica: shm (a "
                                     "shared-memory ring, ranks on one node), gloo (TCP, any nodes); auto: shm "
                                     "where every rank is on one node", ("auto", "shm", "gloo"))
    use_ray: bool = _opt(False, "run on Ray actors even for tp=dp=1 (the default for `shoal serve` on a GPU)")
    disable_request_link: bool = _opt(False, "Ray: send requests and take outputs through actor calls (long polls) "
                                      "instead of the client's direct socket link to each scheduler actor")
    in_process: bool = _opt(False, "tp=dp=1: scheduler and worker in the server's own process, also on a GPU "
                                   "(the default on CPU)")
    address: str | None = _opt(None, "Ray cluster address ('auto' joins a running one); default: $RAY_ADDRESS, else a "
                                     "local cluster of its own (--ray-join-running: the one `ray start` runs here)")
    ray_join_running: bool = _opt(False, "on Ray with no --address or $RAY_ADDRESS: join the cluster `ray start` runs "
                                         "on this machine, if any (vLLM's --distributed-executor-backend ray)")
    placement: str = _opt("pack", "placement of a replica's TP ranks across nodes", ("pack", "spread"))
    routing_policy: str = _opt("cache_aware", "gateway routing across replicas (cache_aware: where the longest "
                                              "prefix is cached, per the replicas' own radix caches)",
                               ("cache_aware", "round_robin", "least_load", "prefix_hash"))
    balance_abs_threshold: int = _opt(32, "cache_aware: past this many more requests in flight than the least "
                                          "loaded replica (and --balance-rel-threshold times as many), route by load")
    balance_rel_threshold: float = _opt(1.5, "cache_aware: the relative half of that imbalance test")
    # HTTP
    host: str = _opt("127.0.0.1", "HTTP host")
    port: int = _opt(30000, "HTTP port")
    api_key: tuple[str, ...] | None = _opt(None, "require 'Authorization: Bearer KEY' on every route but /health*, "
                                                 "/metrics, /ping, /version and /dashboard; several keys (vLLM's "
                                                 "--api-key k1 k2): any one; `shoal serve` reads $VLLM_API_KEY "
                                                 "when none is given")
    admin_api_key: str | None = _opt(None, "SGLang's: the one key the operator routes (weights, pause, sleep, LoRA "
                                           "loading, cache flush, profiling, /abort_request) take; --api-key keys "
                                           "are refused there. Without it --api-key guards them too")
    timeout_keep_alive: float = _opt(5.0, "seconds a connection may sit idle, or take to send a request's headers, "
                                          "before it is closed (uvicorn's, as vLLM and SGLang serve)")
    max_request_bytes: int = _opt(8 * 1024 * 1024, "largest accepted request body")
    enable_force_include_usage: bool = _opt(False, "streamed completions and chat completions carry usage as if "
                                                   "every request asked stream_options {include_usage, "
                                                   "continuous_usage_stats} (vLLM's flag; a request's false is "
                                                   "overridden, as there)")
    max_n: int = _opt(16, "largest n (choices per request)")
    max_concurrent_requests: int | None = _opt(None, "most requests in flight (each choice counts); past it a new one gets 429")
    max_queue_wait_s: float = _opt(30.0, "refuse a request (429 + Retry-After) when its estimated wait in the "
                                         "queue (from waiting tokens, free KV and recent rates) exceeds this")
    max_waiting_requests: int = _opt(4096, "refuse a request (429 + Retry-After) when more requests than this "
                                           "already wait to be scheduled")
    allowed_origins: str = _opt("*", "CORS: origins a browser page may call the API from, comma-separated or "
                                     "vLLM's JSON list ('[\"https://a.com\"]'); '*': any, '' turns CORS off")
    allowed_methods: str = _opt("*", "CORS: methods a preflight may ask for (a list as --allowed-origins; '*': any)")
    allowed_headers: str = _opt("*", "CORS: request headers a preflight may ask for beyond the CORS-safelisted ones "
                                     "(a list as --allowed-origins; '*': any)")
    allow_credentials: bool = _opt(False, "CORS: answer Access-Control-Allow-Credentials: true (with the page's "
                                          "origin, never '*')")
    disable_access_log: bool = _opt(False, "no access log line (method, path, status, request id, latency) per "
                                           "request")
    disable_access_log_for_endpoints: str | None = _opt(None, "paths whose requests get no access log line, "
                                                              "comma-separated: /health,/metrics")
    enable_log_requests: bool = _opt(False, "log each request as it is sent to the engine: its id, prompt (see "
                                            "--max-log-len) and sampling params")
    max_log_len: int | None = _opt(None, "--enable-log-requests: a prompt's characters logged; default: all")
    enable_server_load_tracking: bool = _opt(False, "vLLM's: count the requests in flight for GET /load")
    shutdown_timeout_s: float = _opt(25.0, "on SIGINT/SIGTERM, seconds in-flight requests may run on before they "
                                           "are aborted (a second signal aborts them at once); under Kubernetes' "
                                           "30 s default grace period")
    metrics_compat: str = _opt("vllm,sglang", "/metrics also exposes, under vLLM's and/or SGLang's names, types "
                                              "and labels, the series of theirs Shoal measures alike (their "
                                              "dashboards, alerts, autoscalers and the Gateway API Inference "
                                              "Extension keep working): a comma-separated list of vllm, "
                                              "sglang, or none")
    log_level: str = _opt("info", "log level", ("debug", "info", "warning", "error"))
    log_interval_s: float = _opt(10.0, "seconds between scheduler stats log lines")
    profile_dir: str | None = _opt(None, "where POST /start_profile writes each TP rank's torch.profiler trace "
                                         "(Chrome JSON); default: $SHOAL_TORCH_PROFILER_DIR, else profiling is off")

    def __post_init__(self) -> None:
        for name in ("hf_overrides", "pooler_config", "override_generation_config"):  # Engine(name={...}), YAML
            if isinstance(getattr(self, name), Mapping):
                try:
                    object.__setattr__(self, name, json.dumps(dict(getattr(self, name))))
                except (TypeError, ValueError) as e:
                    raise ServerArgsError(_flag(name), f"must be JSON-serializable: {e}") from None
        if isinstance(self.lora_modules, Mapping | list | tuple):  # Engine(lora_modules={name: path}) or a list
            items = self.lora_modules.items() if isinstance(self.lora_modules, Mapping) else None
            object.__setattr__(self, "lora_modules", " ".join(
                [f"{k}={v}" for k, v in items] if items is not None else [str(x) for x in self.lora_modules]))
        object.__setattr__(self, "served_model_aliases", served_model_aliases(self.served_model_name,
                                                                                self.served_model_aliases))
        normalize_http_flags(self)  # key tuples, Engine(...) or YAML lists
        check_field_types(self)
        _hf_overrides(self.hf_overrides)
        if pooler_config(self.pooler_config) and not self.is_embedding:
            raise ServerArgsError("--pooler-config", "applies to an embedding server (--is-embedding)")
        positive = ("mem_fraction_static", "max_running_requests", "max_prefill_tokens", "tp_size",
                    "dp_size", "cuda_graph_max_bs", "max_request_bytes", "max_n", "init_new_token_ratio",
                    "max_queue_wait_s", "max_waiting_requests", "balance_rel_threshold", "grammar_compile_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ServerArgsError(_flag(name), f"must be positive, got {getattr(self, name)}")
        check_fp8_flags(self)
        for name in ("max_total_tokens", "context_length", "max_concurrent_requests"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ServerArgsError(_flag(name), f"must be positive, got {v}")
        if self.mem_fraction_static > 1.0:
            raise ServerArgsError("--mem-fraction-static", f"must be in (0, 1], got {self.mem_fraction_static}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ServerArgsError("--chunked-prefill-size", f"must be -1 (off) or positive, got {self.chunked_prefill_size}")
        if self.balance_abs_threshold < 0:
            raise ServerArgsError("--balance-abs-threshold", f"must be >= 0, got {self.balance_abs_threshold}")
        if self.watchdog_timeout is not None and self.watchdog_timeout != self.watchdog_timeout:  # NaN
            raise ServerArgsError("--watchdog-timeout", "must be a number of seconds (<= 0 or inf turns it off), got nan")
        if not self.retract_ratio_growth >= 1.0:  # NaN too
            raise ServerArgsError("--retract-ratio-growth", f"must be >= 1 (1 turns it off), got {self.retract_ratio_growth}")
        if not 0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0:
            raise ServerArgsError("--min-new-token-ratio", "need 0 <= min ratio <= init ratio <= 1")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in (*choices, f.default):  # None: an optional flag left out
                raise ServerArgsError(_flag(f.name), f"must be one of {', '.join(map(str, choices))}, got {getattr(self, f.name)!r}")
        for name, allowed in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                raise ServerArgsError(_flag(name), f"must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        _metrics_compat(self.metrics_compat)
        check_http_flags(self)
        check_revisions(self)
        if self.chat_template is not None:
            read_chat_template(self.chat_template)  # before any weights load: a bad one names the flag now
        if self.in_process and self.uses_ray:
            raise ServerArgsError("--in-process", "runs one replica of one rank without Ray: drop --tp-size, "
                                                  "--dp-size, --address and --use-ray, or this flag")
        if self.enable_dp_attention and self.dp_size < 2:
            raise ServerArgsError("--enable-dp-attention", "needs --dp-size of 2 or more")
        if self.is_embedding and (self.speculative_algorithm or self.enable_dp_attention):
            raise ServerArgsError("--is-embedding", "an embedding server only prefills: it runs without "
                                                    "--speculative-algorithm and --enable-dp-attention")
        check_speculative_flags(self)
        check_generation_flags(self)
        check_lora_flags(self)
        check_priority_flags(self)

    @property
    def priority_scheduling(self) -> bool:
        """Requests' priorities order the queue and preempt (either spelling of the flag)."""
        return self.enable_priority_scheduling or self.scheduling_policy == "priority"

    @property
    def priority_low_values_first(self) -> bool:
        return self.schedule_low_priority_values_first or self.scheduling_policy == "priority"

    @property
    def priority_preemption_threshold(self) -> int:  # vLLM preempts for any better priority, SGLang past 10
        t = self.priority_scheduling_preemption_threshold
        return t if t is not None else 0 if self.scheduling_policy == "priority" else 10

    @property
    def uses_ray(self) -> bool:
        return self.use_ray or self.tp_size > 1 or self.dp_size > 1 or self.address is not None

    @property
    def fp8_lm_head_mode(self) -> str:
        """The LM head's FP8 use with FP8 weights: on (--fp8-lm-head), off (--disable-fp8-lm-head) or auto."""
        return "on" if self.fp8_lm_head else "off" if self.disable_fp8_lm_head else "auto"

    @property
    def generation_config_source(self) -> str:
        """auto (the model folder's generation_config.json), vllm (none) or the folder to read it from."""
        return "vllm" if self.sampling_defaults == "openai" else self.generation_config

    @property
    def hf_config_overrides(self) -> dict[str, Any]:
        """--hf-overrides as a dict ({} without it): its keys replace config.json's top-level ones."""
        return _hf_overrides(self.hf_overrides)

    @property
    def pooler_overrides(self) -> dict[str, Any]:
        """--pooler-config's keys as text/pooling_config.py applies them over the folder's ({} without it)."""
        return pooler_config(self.pooler_config)

    @property
    def metrics_compat_names(self) -> tuple[str, ...]:
        """The peers (of METRICS_COMPAT) whose /metrics names are exposed too; () for none."""
        return _metrics_compat(self.metrics_compat)

    @property
    def radix_cache_enabled(self) -> bool:
        """A generation server's prefix cache; an embedding server's depends on its pooling: prefix_cache_for."""
        return not self.disable_radix_cache and not self.is_embedding

    def prefix_cache_for(self, pooling: str | None) -> bool:
        # Last-token pooling reads the last position only, which every prefill computes (a cache match stops
        # a token short of the prompt); mean and CLS read every position, a cached one was never computed here.
        return not self.disable_radix_cache and (not self.is_embedding or pooling == "last")

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        kwargs, names = translate_vllm_kwargs(kwargs), {f.name for f in dataclasses.fields(cls)}  # vLLM's LLM(...)
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ServerArgsError(_flag(unknown[0]), "unknown server argument")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, place: FlagPlacement | None = None) -> None:
        add_server_flags(parser, dataclasses.fields(cls), place)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})  # lists: __post_init__
