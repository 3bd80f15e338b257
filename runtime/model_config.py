"""ModelConfig: the fields of a HF config.json that the engine needs, checked once."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from runtime.classifier_config import (  # noqa: F401 (classifier_labels: re-exported)
    classifier_labels,
    classifier_token_ids,
    classifier_tokens,
    is_classifier_architecture,
)
from runtime.errors import ModelConfigError
from runtime.sampling.generation_defaults import CONFIG_NAME, FILE_NAME, TEXT_CONFIGS

# The one list of architectures: config.json `architectures` name → (model_type, the class that runs it,
# as "module:Class" so this foundation module imports nothing of runtime.models; models/registry.py reads it).
SUPPORTED_ARCHITECTURES = MappingProxyType({
    "LlamaForCausalLM": ("llama", "runtime.models.llama:LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "runtime.models.llama:MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "runtime.models.qwen2:Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "runtime.models.qwen3:Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "runtime.models.mixtral:MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "runtime.models.qwen2_moe:Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "runtime.models.qwen3_moe:Qwen3MoeForCausalLM"),
    # Bare models (no LM head), as embedding checkpoints declare them: e5-mistral-7b-instruct (MistralModel),
    # Qwen3-Embedding (Qwen3Model), gte-Qwen2-1.5B-instruct (Qwen2Model; its config.json says is_causal false
    # though its HF code runs causal: it needs --hf-overrides '{"is_causal": true}', and a truly bidirectional
    # one, gte-Qwen2-7B-instruct per vLLM, is refused: text/pooling_config.py). They run on the causal class
    # (the model runner adds the 'model.' prefix; no LM head is built), only on an embedding server
    # (is_bare_architecture).
    "LlamaModel": ("llama", "runtime.models.llama:LlamaForCausalLM"),
    "MistralModel": ("mistral", "runtime.models.llama:MistralForCausalLM"),
    "Qwen2Model": ("qwen2", "runtime.models.qwen2:Qwen2ForCausalLM"),
    "Qwen3Model": ("qwen3", "runtime.models.qwen3:Qwen3ForCausalLM"),
    # Reward and classification models (Skywork-Reward-Llama-3.1-8B, Qwen2.5 / Qwen3 classifiers): the decoder
    # and `score` [num_labels, hidden] on the last token, only on an embedding server (vLLM's --task classify).
    "LlamaForSequenceClassification": ("llama", "runtime.models.sequence_classification:LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("mistral",
                                         "runtime.models.sequence_classification:MistralForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("qwen2", "runtime.models.sequence_classification:Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("qwen3", "runtime.models.sequence_classification:Qwen3ForSequenceClassification"),
})


def is_bare_architecture(architecture: str) -> bool:
    """A checkpoint of the bare *Model: hidden states only, no LM head (embedding models)."""
    return not architecture.endswith("ForCausalLM")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    scaling_type: str = "default"  # default | llama3 | linear | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (Qwen2.5 / Qwen3 past 32k tokens, as their cards set rope_scaling): the ramp's bounds in rotations,
    # whether they round outward, and the factor cos/sin are scaled by (HF's attention_factor, computed)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The mixture-of-experts fields (Mixtral, Qwen2-MoE, Qwen3-MoE), named as HF names them."""

    num_experts: int  # num_local_experts (Mixtral) / num_experts (Qwen)
    num_experts_per_tok: int
    moe_intermediate_size: int  # each expert's; Mixtral's is its intermediate_size
    norm_topk_prob: bool  # renormalize the top-k softmax weights (Mixtral always does)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, sigmoid-gated
    decoder_sparse_step: int = 1  # layer i is sparse where (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (these keep the dense MLP)
    # HF's Mixtral keeps the routing weights in fp32; Qwen's cast them back to the model dtype
    router_weights_fp32: bool = False

    def is_sparse_layer(self, layer_id: int) -> bool:
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm on q and k per head
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    # Per layer, how many of the latest tokens a query sees (0: all of them). Empty: no layer has a window.
    sliding_windows: tuple[int, ...] = ()
    moe: MoeConfig | None = None  # None: every layer has the dense MLP
    num_labels: int = 0  # a *ForSequenceClassification's classes (its score head's rows); 0 for other models
    # classifier_from_token's ids: the score head is made of their LM-head rows at load; () if it has its own
    classifier_token_ids: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_sparse_layer(self, layer_id: int) -> bool:
        return self.moe is not None and self.moe.is_sparse_layer(layer_id)

    @property
    def is_bare(self) -> bool:
        return is_bare_architecture(self.architecture)

    def check_task(self, is_embedding: bool, model_path: str | Path) -> None:
        """A bare model has no LM head to generate with: refused on a generation server, by name, rather
        than served with a stand-in head (every logit zero)."""
        if is_classifier_architecture(self.architecture) and not is_embedding:
            raise ModelConfigError(f"{model_path}: {self.architecture} is a sequence-classification (reward) "
                                   "model with no LM head: serve it with --is-embedding (vLLM's --task classify) "
                                   "and ask POST /classify or /v1/embeddings for its scores")
        if self.is_bare and not is_embedding:
            raise ModelConfigError(f"{model_path}: {self.architecture} is a bare model (no LM head): serve it "
                                   "with --is-embedding (vLLM's --task embed)")

    @property
    def has_sliding_window(self) -> bool:
        return any(self.sliding_windows)

    def layer_sliding_window(self, layer_id: int) -> int:
        return self.sliding_windows[layer_id] if self.sliding_windows else 0

    @classmethod
    def from_pretrained(cls, model_path: str | Path, dtype: str = "auto", overrides: Mapping[str, Any] | None = None,
                        generation_config: str = "auto") -> ModelConfig:
        """overrides: --hf-overrides, whose keys replace config.json's top-level ones before anything is
        read (vLLM's flag; a nested value such as rope_scaling is replaced whole). generation_config:
        --generation-config, whose folder's generation_config.json eos_token_id (else its config.json's) ends
        requests (auto, vllm: the model's own)."""
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"no config.json in model folder {model_path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path} is not a JSON object")
        cfg = cls.from_dict(merged := _with_overrides(raw, overrides or {}), dtype=dtype)
        own = generation_config in ("auto", "vllm")
        folder = path.parent if own else Path(generation_config)
        if extra := [i for i in _generation_eos(folder, fallback=not own) if i not in cfg.eos_token_ids]:
            cfg = dataclasses.replace(cfg, eos_token_ids=(*cfg.eos_token_ids, *extra))
        tokens = classifier_tokens(merged)
        if tokens and not cfg.num_labels:
            raise ModelConfigError(f"classifier_from_token makes a classifier of {cfg.architecture}: also override "
                                   'architectures, as in {"architectures": ["Qwen3ForSequenceClassification"]}')
        return dataclasses.replace(cfg, classifier_token_ids=classifier_token_ids(path.parent, tokens)) if tokens else cfg

    @classmethod
    def from_dict(cls, raw: dict[str, Any], dtype: str = "auto") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or 'missing'} (config field 'architectures'); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = SUPPORTED_ARCHITECTURES[arch][0]

        def need(name: str, kind: type = int) -> Any:
            if name not in raw or raw[name] is None:
                raise ModelConfigError(f"config.json of {arch} is missing required field '{name}'")
            v = raw[name]
            if kind is int and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ModelConfigError(f"config field '{name}' must be a positive integer, got {v!r}")
            if kind is float and (not isinstance(v, (int, float)) or v <= 0):
                raise ModelConfigError(f"config field '{name}' must be a positive number, got {v!r}")
            return v

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads", heads)
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise ModelConfigError(
                f"config field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})")
        head_dim = raw.get("head_dim") or hidden // heads
        if raw.get("head_dim") is None and hidden % heads:
            raise ModelConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"config field 'hidden_act' must be 'silu', got {act!r}")
        if raw.get("mlp_bias"):  # the MLP layers carry no bias: loading would silently drop the checkpoint's
            raise ModelConfigError("config field 'mlp_bias' is true; MLP biases are not supported")
        # Llama's and Qwen3's attention_bias puts a bias on o_proj too (Qwen2's is q/k/v only), which our
        # o_proj lacks: loading would drop it silently.
        if raw.get("attention_bias") and model_type in ("llama", "qwen3", "qwen3_moe"):
            raise ModelConfigError(f"config field 'attention_bias' is true for a {model_type} model, whose o_proj "
                                   "then has a bias; o_proj biases are not supported (Qwen2's q/k/v biases are)")
        layers = need("num_hidden_layers")
        moe = _moe(raw, model_type, layers, need)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        rope = _rope(raw)
        max_pos = need("max_position_embeddings")
        if rope.scaling_type == "yarn":  # the context yarn was set for, as vLLM derives its max_model_len
            max_pos = max(max_pos, int(rope.original_max_position_embeddings * rope.factor))
        return cls(
            architecture=arch, model_type=model_type,
            vocab_size=need("vocab_size"), hidden_size=hidden,
            intermediate_size=need("intermediate_size"), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope, max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(raw, model_type),
            qk_norm=model_type in ("qwen3", "qwen3_moe"), dtype=_dtype(raw, dtype), eos_token_ids=eos_ids,
            sliding_windows=_sliding_windows(raw, model_type, layers), moe=moe,
            num_labels=len(classifier_labels(raw)) if is_classifier_architecture(arch) else 0,
        )


def _with_overrides(raw: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = {**raw, **overrides}
    # transformers 5 writes rope_scaling's fields into rope_parameters, which _rope reads first: an overridden
    # rope_scaling (the override vLLM users write) replaces them there too, keeping the config's theta.
    params = raw.get("rope_parameters")
    if "rope_scaling" in overrides and "rope_parameters" not in overrides and isinstance(params, dict):
        theta = {k: v for k, v in params.items() if k == "rope_theta"}
        merged["rope_parameters"] = {**theta, **(overrides["rope_scaling"] or {})}
    return merged


def _attention_bias(raw: dict[str, Any], model_type: str) -> bool:
    """Qwen2 (and Qwen2-MoE) put a bias on q/k/v; Qwen2-MoE's HF model reads only qkv_bias (default true)."""
    if model_type == "qwen2_moe":
        return bool(raw.get("qkv_bias", True))
    return bool(raw.get("attention_bias", model_type == "qwen2"))


def _moe(raw: dict[str, Any], model_type: str, num_layers: int, need: Any) -> MoeConfig | None:
    """The MoE fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json, each checked; None for dense models."""
    if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return None
    # Mixtral names it num_local_experts; Qwen's published configs num_experts (transformers 5 writes
    # num_local_experts for Qwen3-MoE too).
    field = "num_local_experts" if model_type == "mixtral" or "num_experts" not in raw else "num_experts"
    experts, top_k = need(field), need("num_experts_per_tok")
    if top_k > experts:
        raise ModelConfigError(f"config field 'num_experts_per_tok' ({top_k}) exceeds '{field}' ({experts})")
    if model_type == "mixtral":
        return MoeConfig(experts, top_k, need("intermediate_size"), norm_topk_prob=True, router_weights_fp32=True)
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ModelConfigError(f"config field 'norm_topk_prob' must be true or false, got {norm!r}")
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        raise ModelConfigError(f"config field 'decoder_sparse_step' must be a positive integer, got {step!r}")
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                              and 0 <= i < num_layers for i in dense):
        raise ModelConfigError(f"config field 'mlp_only_layers' must be a list of layer indices in "
                               f"[0, {num_layers}), got {dense!r}")
    shared = need("shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0
    return MoeConfig(experts, top_k, need("moe_intermediate_size"), norm_topk_prob=norm,
                     shared_expert_intermediate_size=shared, decoder_sparse_step=step,
                     mlp_only_layers=tuple(sorted(set(dense))))


def _rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes rope_parameters; published configs carry rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "llama3", "linear", "yarn"):
        raise ModelConfigError(f"unsupported rope_scaling type {kind!r}; supported: default, llama3, linear, yarn")
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelConfigError(f"config field 'rope_theta' must be positive, got {theta!r}")
    factor = params.get("factor", 1.0)
    original = params.get("original_max_position_embeddings", 8192)
    if kind == "yarn" and params.get("original_max_position_embeddings") is None:
        raise ModelConfigError("rope_scaling yarn needs original_max_position_embeddings")
    if factor is None and kind == "yarn":  # DeepSeek's convention, as HF: the ratio of the two lengths
        factor = raw.get("max_position_embeddings", original) / original
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ModelConfigError(f"rope_scaling factor must be positive, got {factor!r}")
    return RopeConfig(
        theta=float(theta), scaling_type=kind, factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=_yarn_attention_factor(params, float(factor)) if kind == "yarn" else 1.0,
    )


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """HF's: attention_factor when given, else 0.1 ln(factor) + 1 (with DeepSeek's mscale / mscale_all_dim)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def _sliding_windows(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """Which layers attend within a window, as transformers decides: Mistral every layer when
    sliding_window is set; Qwen2/Qwen3 only with use_sliding_window, the layers its `layer_types` marks
    (else those from max_window_layers on, default 28); Qwen3-MoE every layer with use_sliding_window;
    Qwen2-MoE its layer_types (else the odd-numbered layers below max_window_layers, as its HF config
    builds them); Llama never (its HF model ignores the field)."""
    window = raw.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return ()
    if model_type in ("mistral", "mixtral"):
        return (window,) * num_layers
    if model_type not in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") or not raw.get("use_sliding_window", False):
        return ()
    if model_type == "qwen3_moe":
        return (window,) * num_layers
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif model_type == "qwen2_moe":
        last = raw.get("max_window_layers", 28)
        last = last if isinstance(last, int) and not isinstance(last, bool) else 28
        windows = tuple(window if (i + 1) % 2 and i < last else 0 for i in range(num_layers))
    else:
        first = raw.get("max_window_layers", 28)
        first = first if isinstance(first, int) and not isinstance(first, bool) else 28
        windows = tuple(window if i >= first else 0 for i in range(num_layers))
    return windows if any(windows) else ()


def _dtype(raw: dict[str, Any], requested: str) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ModelConfigError(f"config field 'torch_dtype' has unsupported dtype {name!r}")
    return _DTYPES[name]


def _generation_eos(folder: Path, fallback: bool = False) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an id or a list): ends a request as config.json's do, as vLLM
    and SGLang add them to the stop ids (Qwen2.5-Instruct's <|endoftext|> is only there). vLLM takes them
    from the file its sampling defaults come from: a --generation-config folder's replaces the model's (and
    vllm, which reads no sampling key, still takes the model's). fallback (a --generation-config folder): one
    without generation_config.json has its config.json's instead, the top level's else a decoder's text
    config's, as vLLM's try_get_generation_config (GenerationConfig.from_model_config) reads it; the model's
    own config.json needs none, its ids (--hf-overrides applied) being the model's already. An unreadable
    file adds none: its sampling keys are read, and checked, by sampling/generation_defaults.py."""
    path = folder / FILE_NAME
    if fallback and not path.is_file():
        path = folder / CONFIG_NAME
    try:
        raw = json.loads(path.read_text())
        eos = raw.get("eos_token_id")
        if eos is None and path.name == CONFIG_NAME:
            eos = next((t["eos_token_id"] for name in TEXT_CONFIGS
                        if isinstance(t := raw.get(name), dict) and t.get("eos_token_id") is not None), None)
    except (OSError, ValueError, AttributeError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))
