"""SamplingParams: what a request asks of the sampler and the stop rules, validated once at the boundary."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import msgspec

from runtime.errors import InvalidRequestError

if TYPE_CHECKING:
    from runtime.sampling.generation_defaults import GenerationDefaults

# Integers reach the sampler as int64 tensors (and cross the Ray wire as msgpack, which stops at 2**64):
# anything larger would fail a whole batch, so it is refused here, naming its field.
INT64_MAX = 2**63 - 1
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
# vLLM's limits (VLLM_MAX_NUM_BAD_WORDS, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS): every step matches them all.
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOKENS = 1024


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
    include_stop_str_in_output: bool = False  # vLLM's name: the matched stop string stays in the text
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = {}  # token id → added to its logit before sampling (OpenAI: [-100, 100])
    allowed_token_ids: list[int] | None = None  # vLLM's: only these ids may be sampled (None: any)
    # vLLM's: words never generated. Only where a tokenizer is (the Engine, the gateway) do the strings
    # become token ids (runtime/text/bad_words.py), into bad_words_ids; a scheduler refuses strings left over.
    bad_words: list[str] = []
    # Token id sequences never completed: a sequence's last id is banned while the output ends with the rest.
    bad_words_ids: list[list[int]] = []
    # Structured output: at most one grammar constrains every sampled token (xgrammar compiles it).
    json_schema: str | None = None  # a JSON Schema as JSON text
    regex: str | None = None
    ebnf: str | None = None
    # Reasoning models: the grammar waits until this token (the think-end tag, e.g. </think>) is sampled, and
    # constrains from the token after it; the tokens up to and including it are free. None: from the first token.
    grammar_after_token: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, defaults: GenerationDefaults | None = None) -> SamplingParams:
        """Builds from a user dict; unknown keys and wrong types are InvalidRequestError. defaults: the server's
        (the model's generation_config.json) for the fields d leaves unset; a SamplingParams is taken as is."""
        if isinstance(d, SamplingParams):
            return d
        if d is None and defaults is None:
            return cls()
        if not isinstance(d, dict | None):
            raise InvalidRequestError("sampling_params must be an object", param="sampling_params")
        d = defaults.fill(d or {}) if defaults is not None else dict(d)
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        for key in ("stop", "bad_words", "bad_words_ids"):  # null: none, as vLLM reads it
            if d.get(key) is None:
                d.pop(key, None)
        for alias, name in (("sampling_seed", "seed"), ("no_stop_trim", "include_stop_str_in_output")):
            if alias in d:  # SGLang's name for the same knob
                value = d.pop(alias)
                if value is not None and d.get(name) is not None and d[name] != value:
                    raise InvalidRequestError(f"{name} ({d[name]!r}) and {alias} ({value!r}, SGLang's name for "
                                              "it) differ: give one", param=alias)
                if value is not None:
                    d[name] = value
        if isinstance(d.get("json_schema"), dict):  # a schema given as an object rather than JSON text
            d["json_schema"] = json.dumps(d["json_schema"])
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
        cap = defaults.max_new_tokens_cap if defaults is not None else None
        if cap is not None and params.max_new_tokens > cap:  # again once converted: 100.0 and "100" are 100 too
            params = msgspec.structs.replace(params, max_new_tokens=cap)
        params.validate()
        return params

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar constraining the output — the compile cache's key — or None."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def needs_recent_output(self) -> bool:
        """The next token's mask depends on the tokens just sampled (a bad word of several tokens): overlap
        scheduling must collect the batch in flight before building the next one."""
        return any(len(w) > 1 for w in self.bad_words_ids)

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )

    def validate(self) -> None:
        """InvalidRequestError naming the first bad field. Also for a SamplingParams built directly (its
        constructor checks no types): a value of the wrong type is refused, never a TypeError."""
        try:
            self._validate()
        except TypeError as e:
            raise InvalidRequestError(f"a sampling parameter has the wrong type: {e}", param="sampling_params") from None

    def _validate(self) -> None:
        bad, integer = _bad, _integer

        integer("max_new_tokens", self.max_new_tokens, 1, INT64_MAX, " (it is clipped to the context length)")
        integer("min_new_tokens", self.min_new_tokens, 0, INT64_MAX)
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise bad(
                "min_new_tokens",
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
            )
        if not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1:
            integer("top_k", self.top_k, 1, INT64_MAX,
                    " or -1 (disabled); a top_k at or past the vocabulary size keeps every token")
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
        for t in self.stop_token_ids:  # one outside the vocabulary never matches: allowed, as in vLLM
            integer("stop_token_ids", t, 0, INT64_MAX, what="each of stop_token_ids")
        integer("top_logprobs_num", self.top_logprobs_num, 0, 20, " (OpenAI's limit)")
        if self.seed is not None:
            integer("seed", self.seed, 0, INT64_MAX)
        if len(self.logit_bias) > 300:
            raise bad("logit_bias", f"logit_bias may name at most 300 tokens, got {len(self.logit_bias)}")
        for t, v in self.logit_bias.items():
            integer("logit_bias", t, 0, INT64_MAX, what="each logit_bias key (a token id)")
            if not -100.0 <= v <= 100.0:
                raise bad("logit_bias", f"logit_bias maps token ids >= 0 to values in [-100, 100], got {t}: {v}")
        self._validate_token_sets()
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise bad(given[1], f"give at most one of json_schema, regex and ebnf, got {' and '.join(given)}")
        for kind in given:
            if not isinstance(getattr(self, kind), str) or not getattr(self, kind):
                raise bad(kind, f"{kind} must be a non-empty string")
        if self.grammar_after_token is not None:  # the vocabulary's end is checked by validate_request
            integer("grammar_after_token", self.grammar_after_token, 0, INT64_MAX,
                    what="grammar_after_token (a token id)")
            if not given:  # it would silently do nothing: say so
                raise bad("grammar_after_token", "grammar_after_token needs a grammar (json_schema, regex or ebnf)")

    def _validate_token_sets(self) -> None:
        """allowed_token_ids, bad_words and bad_words_ids (their ids' vocabulary end: validate_request)."""
        bad, integer = _bad, _integer
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:  # vLLM refuses it too: nothing could be sampled
                raise bad("allowed_token_ids", "allowed_token_ids must not be empty (leave it out to allow any token)")
            for t in self.allowed_token_ids:
                integer("allowed_token_ids", t, 0, INT64_MAX, what="each of allowed_token_ids (a token id)")
            # Sorted and unique from here on: the scheduler's mask and its membership test (bisect) rely on it.
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise bad("bad_words", f"at most {MAX_BAD_WORDS} bad_words, got {len(self.bad_words)}")
        if any(not isinstance(w, str) or not w.strip() or len(w) > 1024 for w in self.bad_words):
            raise bad("bad_words", "bad_words must be non-blank strings of at most 1024 characters")
        if len(self.bad_words_ids) > MAX_BAD_WORDS:
            raise bad("bad_words_ids", f"at most {MAX_BAD_WORDS} bad word token sequences (bad_words give one or "
                                       f"two each), got {len(self.bad_words_ids)}")
        if any(not isinstance(w, list) or not w for w in self.bad_words_ids):
            raise bad("bad_words_ids", "each of bad_words_ids must be a non-empty list of token ids")
        if sum(map(len, self.bad_words_ids)) > MAX_BAD_WORDS_TOKENS:
            raise bad("bad_words_ids", f"bad words may hold at most {MAX_BAD_WORDS_TOKENS} tokens in all, got "
                                       f"{sum(map(len, self.bad_words_ids))}")
        for w in self.bad_words_ids:
            for t in w:
                integer("bad_words_ids", t, 0, INT64_MAX, what="each id of bad_words_ids")


def _bad(param: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(msg, param=param)


def _integer(param: str, v: object, lo: int, hi: int, why: str = "", what: str = "") -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(param, f"{what or param} must be an integer in [{lo}, {_name(hi)}]{why}, got {v!r}")


def _name(n: int) -> str:
    """2**63 - 1 reads better in a message than 9223372036854775807."""
    return "2**63 - 1" if n == INT64_MAX else str(n)
