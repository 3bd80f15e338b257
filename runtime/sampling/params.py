"""SamplingParams: what a request asks of the sampler and the stop rules, validated once at the boundary."""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.errors import InvalidRequestError


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = {}  # token id → added to its logit before sampling (OpenAI: [-100, 100])

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Builds from a user dict; unknown keys and wrong types are InvalidRequestError."""
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return d
        if not isinstance(d, dict):
            raise InvalidRequestError("sampling_params must be an object", param="sampling_params")
        d = dict(d)
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("stop") is None:
            d.pop("stop", None)
        try:
            params = msgspec.convert(d, cls, strict=False)
        except msgspec.ValidationError as e:
            msg = str(e)
            param = None
            if "unknown field" in msg.lower():
                param = msg.split("`")[1] if "`" in msg else None
                msg = f"unknown sampling parameter {param!r}" if param else msg
            elif "`$." in msg:  # a wrong type: msgspec names the path, e.g. `$.stop[0]`, `key` in `$.logit_bias`
                param = msg.split("`$.", 1)[1].split("`")[0].split("[")[0].split(".")[0] or None
            raise InvalidRequestError(msg, param=param) from None
        params.validate()
        return params

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg, param=param)

        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise bad(
                "min_new_tokens",
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
            )
        if not self.temperature >= 0.0:
            raise bad("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise bad(name, f"{name} must be in [-2, 2], got {v}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if any(len(s) > 1024 for s in self.stop):
            raise bad("stop", "stop strings must be at most 1024 characters")
        if len(self.stop) > 16:
            raise bad("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be non-negative")
        if not 0 <= self.top_logprobs_num <= 20:
            raise bad("top_logprobs_num", f"top_logprobs_num must be in [0, 20], got {self.top_logprobs_num}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.logit_bias) > 300:
            raise bad("logit_bias", f"logit_bias may name at most 300 tokens, got {len(self.logit_bias)}")
        for t, v in self.logit_bias.items():
            if t < 0 or not -100.0 <= v <= 100.0:
                raise bad("logit_bias", f"logit_bias maps token ids >= 0 to values in [-100, 100], got {t}: {v}")
