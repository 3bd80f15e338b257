"""A copy of the tiny Llama whose tokenizer puts BOS (<|im_start|>, id 1) before every encoded text, and two
LoRA adapters for it ("ad", "ad2"): the model the vLLM-field tests serve (add_special_tokens, lora_path)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
from lora_files import write_adapter  # noqa: E402

BOS = 1


def bos_llama_with_adapters(tiny_llama: Path, root: Path) -> tuple[Path, dict[str, Path]]:
    """(the model folder under root, adapter name -> folder)."""
    model = Path(shutil.copytree(tiny_llama, root / "bos"))
    spec = json.loads((model / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [BOS],
                                                                  "tokens": ["<|im_start|>"]}}}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    adapters = {name: write_adapter(root / name, model, seed, ("q_proj", "v_proj")) for name, seed in
                (("ad", 1), ("ad2", 2))}
    return model, adapters
