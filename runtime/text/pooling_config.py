"""PoolingConfig: how an embedding server (--is-embedding) turns a prompt's final hidden states into one
vector, read from the model folder as vLLM reads it: sentence-transformers' modules.json names the Pooling
module's folder (1_Pooling/config.json: pooling_mode_lasttoken / mean_tokens / cls_token) and whether a
Normalize module follows; config_sentence_transformers.json may carry named prompts; config.json's
is_matryoshka / matryoshka_dimensions say whether `dimensions` may shorten a vector. A folder without
modules.json pools the last token and L2-normalizes (vLLM's default for `--task embed`: Qwen3-Embedding,
e5-mistral-instruct, gte-Qwen2-1.5B-instruct). config.json is read with --hf-overrides merged over it: a
model whose config.json sets is_causal false is refused (Shoal's attention is causal) unless that is a
mislabel, as gte-Qwen2-1.5B-instruct's is (its HF code runs causal; vLLM advises --hf-overrides
'{"is_causal": true}'); a truly bidirectional one, such as gte-Qwen2-7B-instruct per vLLM, stays refused.
A *ForSequenceClassification model (a reward model or classifier) pools its score head's logits,
unnormalized, at the last token (HF's rule) whatever modules.json says, or as --pooler-config's
pooling_type asks (MEAN, CLS); `labels` (id2label) marks it, and `probabilities` turns its logits into
/classify's probs as vLLM's classify pooler does.
--pooler-config (vLLM's, also --override-pooler-config) wins over all of it, as vLLM's does over the model's
and sentence-transformers' defaults: pooling_type, normalize, dimensions (the default of a request that
gives none) and use_activation (an embedder's normalize in vLLM's newer spelling; a classifier's probs).
The runner hands back raw pooled vectors; `shorten` makes each request's answer of one (Matryoshka
truncation, then L2 normalization as `normalize_for` resolves the request's normalize / use_activation
against the model's), so a request may ask for the raw vector of a normalizing model, or the reverse."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.errors import InvalidRequestError, ModelConfigError, ServerArgsError
from runtime.model_config import classifier_labels, is_classifier_architecture

if TYPE_CHECKING:
    from runtime.config import ServerArgs

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' Pooling modes → ours; the modes it has that we do not pool are refused by name.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    pooling_type: str = "last"  # one of POOLING_TYPES
    normalize: bool = True
    hidden_size: int = 0  # the vector's length (config.json), for `dimensions`' bound
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None  # the only dimensions allowed, when the model lists them
    prompts: dict[str, str] = field(default_factory=dict)  # sentence-transformers' named prompts
    default_prompt_name: str | None = None
    source: str = "default"  # where the pooling came from (logs, errors)
    labels: tuple[str, ...] | None = None  # a classifier's class names (id2label, in order); None: an embedder
    problem_type: str | None = None  # config.json's (regression / single_label_ / multi_label_classification)
    dimensions: int | None = None  # --pooler-config's: what a request without `dimensions` gets shortened to
    use_activation: bool = True  # a classifier's: False (--pooler-config) makes probs the raw logits

    @property
    def is_classifier(self) -> bool:
        return self.labels is not None

    def probabilities(self, logits: Sequence[float]) -> list[float]:
        """vLLM's classify activation (transformers' ForSequenceClassification loss rule): regression keeps
        the logits, multi-label classification takes each one's sigmoid, and otherwise one label's sigmoid or
        several labels' softmax (so a 1-label reward model's probs is [sigmoid(score)]). Whether to apply it
        at all is the caller's: a request's use_activation, else --pooler-config's."""
        if self.problem_type == "regression":
            return list(logits)
        if self.problem_type == "multi_label_classification" or len(logits) < 2:
            return [_sigmoid(x) for x in logits]
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = math.fsum(exps)
        return [e / total for e in exps]

    @classmethod
    def read(cls, model_path: str | Path, overrides: Mapping[str, Any] | None = None,
             pooler: Mapping[str, Any] | None = None) -> PoolingConfig:
        """overrides: --hf-overrides (ServerArgs.hf_config_overrides), merged over config.json; pooler:
        --pooler-config (ServerArgs.pooler_overrides), applied over what the folder says."""
        folder = cls._read_folder(Path(model_path), overrides)
        return folder._overridden(pooler) if pooler else folder

    @classmethod
    def _read_folder(cls, root: Path, overrides: Mapping[str, Any] | None) -> PoolingConfig:
        hf = {**(_json(root / "config.json") or {}), **(overrides or {})}
        if hf.get("is_causal") is False:  # our attention is causal: every vector would be silently wrong
            raise ServerArgsError("--is-embedding", f"{root / 'config.json'} sets is_causal false (bidirectional "
                                                    "attention), which Shoal does not run; only causal models "
                                                    "embed. Where the model runs causal in spite of it (as "
                                                    "gte-Qwen2-1.5B-instruct's HF code does), serve it with "
                                                    "--hf-overrides '{\"is_causal\": true}'")
        archs = hf.get("architectures") or []
        if isinstance(archs, list) and archs and is_classifier_architecture(str(archs[0])):
            try:
                labels = classifier_labels(hf)
            except ModelConfigError as e:
                raise ServerArgsError("--is-embedding", f"{root / 'config.json'}: {e}") from None
            problem = hf.get("problem_type")
            return cls(pooling_type="last", normalize=False, hidden_size=len(labels), labels=labels,
                       problem_type=problem if isinstance(problem, str) else None,
                       source="config.json (sequence classification)")
        dims = hf.get("matryoshka_dimensions")
        common: dict[str, Any] = {
            "hidden_size": int(hf.get("hidden_size") or 0),
            "is_matryoshka": bool(hf.get("is_matryoshka")) or dims is not None,
            "matryoshka_dimensions": tuple(int(d) for d in dims) if dims else None,
        }
        st = _json(root / "config_sentence_transformers.json") or {}
        prompts = st.get("prompts") or {}
        if isinstance(prompts, dict):
            common["prompts"] = {str(k): str(v) for k, v in prompts.items()}
        default = st.get("default_prompt_name") or None
        if default is not None and default not in common.get("prompts", {}):  # sentence-transformers refuses it too
            raise ServerArgsError("--is-embedding", f"{root / 'config_sentence_transformers.json'}: "
                                                    f"default_prompt_name {default!r} is not one of its prompts")
        common["default_prompt_name"] = default
        modules = _json(root / "modules.json")
        if not isinstance(modules, list):
            return cls(**common)
        kinds = [m.get("type") for m in modules if isinstance(m, dict)]
        pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING), None)
        normalize = _ST_NORMALIZE in kinds
        if pooling is None:  # modules.json without a Pooling module: vLLM keeps its default (last)
            return cls(normalize=normalize, source="modules.json", **common)
        where = f"{pooling.get('path', '')}/config.json"
        cfg = _json(root / where)
        if not isinstance(cfg, dict):
            raise ServerArgsError("--is-embedding", f"modules.json names a Pooling module but {root / where} is "
                                                    "missing or not a JSON object")
        on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
        unknown = [k for k in on if k not in _ST_MODES]
        if unknown or len(on) != 1:
            raise ServerArgsError("--is-embedding", f"{where} sets pooling modes {on or 'none'}; Shoal pools "
                                                    f"with exactly one of {', '.join(_ST_MODES)}")
        return cls(pooling_type=_ST_MODES[on[0]], normalize=normalize, source=where, **common)

    def _overridden(self, pooler: Mapping[str, Any]) -> PoolingConfig:
        """This folder's pooling with --pooler-config's keys (server_flags.pooler_config's) put over it."""
        def bad(key: str, why: str) -> ServerArgsError:
            return ServerArgsError("--pooler-config", f"key {key!r}: {why}")

        changes = dict(pooler)
        if self.is_classifier:  # the score head's logits: pooled LAST, MEAN or CLS, never normalized
            if changes.get("dimensions"):
                raise bad("dimensions", "applies to embedding models; this one is a *ForSequenceClassification "
                                        "classifier (use_activation turns its probs' activation off)")
            changes.pop("dimensions", None)
            if "normalize" in changes:  # vLLM's older spelling of use_activation (a classifier's false: raw logits)
                if changes.setdefault("use_activation", changes["normalize"]) != changes["normalize"]:
                    raise bad("normalize", "is vLLM's older name of a classifier's use_activation; the two disagree")
                del changes["normalize"]
        elif "use_activation" in changes:  # an embedder's activation is its normalization (vLLM >= 0.11)
            if changes.setdefault("normalize", changes["use_activation"]) != changes["use_activation"]:
                raise bad("use_activation", "is an embedding model's normalize; the two disagree")
            del changes["use_activation"]
        over = "the default (last token, L2-normalized)" if self.source == "default" else self.source
        out = dataclasses.replace(self, **changes, source=f"--pooler-config over {over}")
        if out.dimensions is not None:
            try:
                out.check_dimensions(out.dimensions)
            except InvalidRequestError as e:
                raise bad("dimensions", str(e)) from None
        return out

    @classmethod
    def for_model(cls, args: ServerArgs, model_path: str | Path) -> PoolingConfig | None:
        """The pooling an --is-embedding server of `args` uses for the folder at model_path: the folder's,
        --hf-overrides merged into its config.json, --pooler-config over it; None for a generation server."""
        if not args.is_embedding:
            return None
        return cls.read(model_path, args.hf_config_overrides, args.pooler_overrides)

    @classmethod
    def for_server(cls, args: ServerArgs) -> PoolingConfig | None:
        """for_model of the server's model folder (resolved from --model-path); None for generation."""
        if not args.is_embedding:
            return None
        from runtime.default_model import resolve_model

        return cls.for_model(args, resolve_model(args.model_path, args.served_model_name, args.revision)[0])

    def check_dimensions(self, dimensions: int | None) -> None:
        """InvalidRequestError (param dimensions) unless this model may be shortened to `dimensions`."""
        if dimensions is None:
            return
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise InvalidRequestError(f"dimensions must be a positive integer, got {dimensions!r}", param="dimensions")
        if not self.is_matryoshka:
            raise InvalidRequestError("this model does not support matryoshka representation (its config.json "
                                      "sets neither is_matryoshka nor matryoshka_dimensions): changing the output "
                                      "dimensions would give poor embeddings", param="dimensions")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise InvalidRequestError(f"this model only supports dimensions {list(self.matryoshka_dimensions)}, got "
                                      f"{dimensions}", param="dimensions")
        if self.hidden_size and dimensions > self.hidden_size:
            raise InvalidRequestError(f"dimensions {dimensions} exceeds the model's embedding size "
                                      f"{self.hidden_size}", param="dimensions")

    def normalize_for(self, normalize: object = None, use_activation: object = None) -> bool:
        """Whether a request's vector is L2-normalized: its `normalize`, or `use_activation` (vLLM's newer
        name for it; both given must agree), else this model's default. InvalidRequestError naming the
        param for a non-bool, and for true on a classifier (its vectors are the score head's raw logits)."""
        given: tuple[str, bool] | None = None
        for name, value in (("normalize", normalize), ("use_activation", use_activation)):
            if value is None:
                continue
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be true or false, got {value!r}", param=name)
            if given is not None and given[1] != value:
                raise InvalidRequestError("normalize and use_activation (its newer name) disagree",
                                          param="use_activation")
            given = (name, value)
        if given is None:
            return self.normalize
        if given[1] and self.is_classifier:
            raise InvalidRequestError(f"{given[0]} true normalizes an embedding; this model is a "
                                      "*ForSequenceClassification classifier, whose vectors are its score head's "
                                      "raw logits (POST /classify's use_activation gives probabilities)",
                                      param=given[0])
        return given[1]

    def shorten(self, vector: list[float], dimensions: int | None, normalize: bool | None = None) -> list[float]:
        """A request's answer of the runner's raw pooled vector: its first `dimensions` components
        (checked by check_dimensions; None: --pooler-config's default, checked at start), then L2-normalized
        when `normalize` (normalize_for's; None: the model's). Matryoshka truncates before normalizing, as
        vLLM does, so a shortened vector of a normalizing model is unit length again."""
        dimensions = self.dimensions if dimensions is None else dimensions
        head = vector if dimensions is None or dimensions >= len(vector) else vector[:dimensions]
        if not (self.normalize if normalize is None else normalize):
            return head
        norm = math.hypot(*head)  # C-speed and overflow-safe: thousands of components per vector
        return [x / norm for x in head] if norm > 0 else head

    def prompt(self, name: str | None, text: str | None = None) -> str:
        """The text sentence-transformers' encode() puts before an input: `text` if given ('' for none),
        else prompt `name`, else the model's default_prompt_name's prompt, else ''."""
        if text is not None:
            if not isinstance(text, str):
                raise InvalidRequestError(f"prompt must be a string, got {text!r}", param="prompt")
            return text
        name = self.default_prompt_name if name is None else name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(self.prompts) or "none (config_sentence_transformers.json lists no prompts)"
            raise InvalidRequestError(f"unknown prompt_name {name!r}; this model's prompts: {known}",
                                      param="prompt_name")
        return self.prompts[name]


def require_classifier(pooling: PoolingConfig | None) -> PoolingConfig:
    """The server's pooling if it serves a *ForSequenceClassification model; else InvalidRequestError naming
    `model`, which says what the server serves instead."""
    if pooling is not None and pooling.is_classifier:
        return pooling
    what = ("a generative model" if pooling is None else
            "an embedding model (no score head: its config.json's architectures is not *ForSequenceClassification)")
    raise InvalidRequestError(f"this server serves {what}: classification needs a *ForSequenceClassification "
                              "model served with --is-embedding (vLLM's --task classify)", param="model",
                              code="model_not_supported")


def _sigmoid(x: float) -> float:
    # the two branches keep exp's argument <= 0, so a large |x| neither overflows nor loses the result
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ServerArgsError("--is-embedding", f"cannot read {path}: {e}") from None
