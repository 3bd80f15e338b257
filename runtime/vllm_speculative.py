"""vLLM's --speculative-config (LLM(speculative_config={...})) on Shoal's speculative flags: method ngram is
--speculative-algorithm NGRAM with its prompt-lookup window, draft_model (or a bare "model") is STANDALONE
with --speculative-draft-model-path; the methods that need trained draft heads are refused by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime.errors import ServerArgsError
from runtime.server_flags import json_object
from runtime.vllm_translation import Translation

# Methods that draft with heads trained alongside the target (or with suffix trees): no Shoal counterpart.
_HEADS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "ernie_mtp", "qwen3_next_mtp",
          "longcat_flash_mtp", "glm4_moe_mtp", "suffix", "arctic")
_NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_min/max when neither is given
# Keys that tune how vLLM runs the drafter, not which tokens are drafted or accepted.
_TUNING = ("draft_tensor_parallel_size", "disable_by_batch_size", "disable_logprobs", "max_model_len",
           "quantization", "revision", "code_revision")


def speculative_config(value: Any, tr: Translation, flag: str) -> None:
    cfg = dict(json_object(value, flag, "vLLM SpeculativeConfig keys") if isinstance(value, str) else value) \
        if isinstance(value, str | Mapping) else None
    if cfg is None:
        raise ServerArgsError(flag, f"must be a JSON object of vLLM SpeculativeConfig keys, got {value!r}")
    method, model = cfg.pop("method", None), cfg.pop("model", None)
    if method is None:  # vLLM infers it from the model: "ngram" names the method, anything else is a draft model
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model" if model else None
    if method in _HEADS:
        raise ServerArgsError(flag, f"method {method}: Shoal drafts with NGRAM (the request's own tokens) or "
                                    f"STANDALONE (a small draft model); {method} draft heads are not implemented")
    if method not in ("ngram", "[ngram]", "draft_model"):
        raise ServerArgsError(flag, f"method must be ngram or draft_model (or a draft \"model\"), got {method!r}")
    k = cfg.pop("num_speculative_tokens", None)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ServerArgsError(flag, f"num_speculative_tokens must be a positive integer, got {k!r}")
    tr.set("speculative_num_draft_tokens", k, flag)
    lo, hi = cfg.pop("prompt_lookup_min", None), cfg.pop("prompt_lookup_max", None)
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ServerArgsError(flag, "draft_model needs \"model\": the draft model's folder")
        if lo is not None or hi is not None:
            raise ServerArgsError(flag, "prompt_lookup_min/max are ngram keys; method is draft_model")
        tr.set("speculative_algorithm", "STANDALONE", flag)
        tr.set("speculative_draft_model_path", model, flag)
    else:
        if lo is None or hi is None:  # vLLM: one given sets both, neither is its default
            lo = hi = next((n for n in (lo, hi) if n is not None), _NGRAM_DEFAULT)
        for key, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ServerArgsError(flag, f"{key} must be a positive integer, got {n!r}")
        tr.set("speculative_algorithm", "NGRAM", flag)
        tr.set("speculative_ngram_min_match_window_size", lo, flag)
        tr.set("speculative_ngram_max_match_window_size", hi, flag)
    unknown = sorted(k for k in cfg if k not in _TUNING)
    if unknown:
        raise ServerArgsError(flag, f"keys {', '.join(unknown)} have no Shoal counterpart")
    if cfg:
        tr.note(flag, "keys " + ", ".join(sorted(cfg)), "they tune how vLLM runs its drafter and have no "
                                                        "Shoal counterpart (drafts and acceptance are unchanged)")
