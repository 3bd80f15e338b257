"""Where FP8 weights' top-1 loss comes from, on the embedded SmolLM2 (CPU): each variant quantizes one group
of projections one way (benchmarks.emulated_linear.py emulates the served arithmetic: w8a16 GEMV,
w8a8 torch._scaled_mm with per-token scales) and is compared, teacher-forced, with the bf16 model.

Method (faster than bench_fp8_accuracy's prefill + 63 decode steps, so dozens of variants fit): the bf16
HF model generates 64 greedy tokens for each of the 64 prompts; every variant then runs ONE causal forward
over prompt + those tokens (right-padded, so padding never reaches a real position), and at each of the 64
positions its argmax is compared with the bf16 forward's argmax (agreement) and its logprob of that token
with bf16's (mean |dlogp|). Numbers sit close to bench_fp8_accuracy's but are not the same measurement
(one forward vs a KV-cached decode); bench_fp8_accuracy stays the acceptance number.

    python -m benchmarks.bench_fp8_weight_error_sources --output-file benchmarks/results/fp8_weight_error_sources_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.bench_fp8_accuracy import build_prompts
from benchmarks.common import print_table, write_result
from benchmarks.emulated_linear import EmulatedLinear, block_hadamard, smooth_factors
from runtime.layers.fp8_weight_scales import SEARCH_RATIOS

GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
ALL = tuple(GROUPS)
RATIOS = torch.tensor(SEARCH_RATIOS)
# calibration text for the Hessian-based variants: topics and templates the measured prompts never use
CALIB_TOPICS = ["the Roman aqueducts", "quantum computing", "the Amazon rainforest", "origami", "tea ceremonies",
                "electric cars", "the Silk Road", "penguins"]
CALIB_TEMPLATES = ["Give me a recipe that uses {}.", "<|im_start|>user\nTell me a story about {}.<|im_end|>\n"
                   "<|im_start|>assistant\n", "Write Python code that simulates {}.", "Summarize {} in French."]

# label -> {group: (activation scheme, weight scheme)} (+ "rot_down": True, "bf16_layers": layers kept in
# bf16); groups left out stay bf16
VARIANTS: dict[str, dict[str, Any]] = {
    "w8a8_all (served above M 16, the CPU default)": {g: ("token", "amax") for g in ALL},
    "w8a16_all (the GEMV served at M <= 16)": {g: ("bf16", "amax") for g in ALL},
    "a8_only_all (activations rounded, bf16 weights)": {g: ("token", "bf16") for g in ALL},
    **{f"w8a8_{g}_only": {g: ("token", "amax")} for g in ALL},
    **{f"w8a16_{g}_only": {g: ("bf16", "amax")} for g in ALL},
    **{f"a8_{g}_only": {g: ("token", "bf16")} for g in ALL},
    "w8a8_all_mse_scales (landed)": {g: ("token", "mse") for g in ALL},
    "w8a16_all_mse_scales (landed)": {g: ("bf16", "mse") for g in ALL},
    "w8a8_all_mse_clip_scales": {g: ("token", "mse_clip") for g in ALL},
    "w8a8_mse_with_bf16_gate_up_acts (not landed: gate_up w8a16 at every M)": {
        **{g: ("token", "mse") for g in ALL}, "gate_up": ("bf16", "mse")},
    "w8a8_mse_layer0_bf16": {**{g: ("token", "mse") for g in ALL}, "bf16_layers": (0,)},
    "w8a16_mse_layer0_bf16": {**{g: ("bf16", "mse") for g in ALL}, "bf16_layers": (0,)},
    "w8a8_mse_last_layer_bf16": {**{g: ("token", "mse") for g in ALL}, "bf16_layers": (29,)},
    "w8a8_all_hmse_scales (activation-weighted MSE)": {g: ("token", "hmse") for g in ALL},
    "w8a16_all_hmse_scales": {g: ("bf16", "hmse") for g in ALL},
    "w8a8_all_gptq": {g: ("token", "gptq") for g in ALL},
    "w8a16_all_gptq": {g: ("bf16", "gptq") for g in ALL},
    "w8a8_all_gptq_hmse_scales": {g: ("token", "gptq_mse") for g in ALL},
    "w8a8_all_down_hadamard_gptq": {**{g: ("token", "gptq") for g in ALL}, "rot_down": True},
    "w8a8_all_group64_acts": {g: ("group64", "amax") for g in ALL},
    "w8a8_all_down_hadamard": {**{g: ("token", "amax") for g in ALL}, "rot_down": True},
    "w8a8_all_down_hadamard_mse": {**{g: ("token", "mse") for g in ALL}, "rot_down": True},
    # two-term activations: x ~ q1 s1 + q2 s2 (the first rounding's residual rounded again), as one w8a8
    # GEMM over 2M rows would serve it (the weight still read once)
    "w8a8x2_all_hmse (two-term activations)": {g: ("token2", "hmse") for g in ALL},
    "w8a8x2_all_mse (two-term activations)": {g: ("token2", "mse") for g in ALL},
    # two terms for one group's input only (the rest one term): where the second term buys the most
    **{f"w8a8x2_{g}_only_hmse": {**{h: ("token", "hmse") for h in ALL}, g: ("token2", "hmse")} for g in ALL},
    "w8a8x2_qkv_gate_up_hmse (the two norm outputs)": {**{h: ("token", "hmse") for h in ALL},
                                                       "qkv": ("token2", "hmse"), "gate_up": ("token2", "hmse")},
    # SmoothQuant: one s per group input (q/k/v share theirs, gate/up theirs), o_proj left unsmoothed (its
    # input is the attention output; folding 1/s into v_proj would need one s per KV head's channels)
    **{f"w8a8_all_smooth{a}_hmse": {**{g: ("token", "hmse") for g in ALL}, "smooth": a, "smooth_groups": ("qkv", "gate_up", "down")}
       for a in (0.3, 0.5, 0.7)},
    "w8a8_all_smooth0.5_amax": {**{g: ("token", "amax") for g in ALL}, "smooth": 0.5, "smooth_groups": ("qkv", "gate_up", "down")},
    "w8a16_all_smooth0.5_hmse (the GEMV on smoothed weights)": {**{g: ("bf16", "hmse") for g in ALL}, "smooth": 0.5,
                                                              "smooth_groups": ("qkv", "gate_up", "down")},
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--chunk", type=int, default=16, help="prompts per forward")
    p.add_argument("--variants", default=None, help="comma-separated substrings: run the variants matching any")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def _silu_mul_once(self: Any, x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP.forward as Shoal computes it: silu(gate) * up in fp32, rounded to bf16 once."""
    g, u = self.gate_proj(x).float(), self.up_proj(x).float()
    return self.down_proj((torch.nn.functional.silu(g) * u).to(x.dtype))


class Harness:
    def __init__(self, model_path: str, num_prompts: int, gen_len: int, chunk: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
        for layer in self.model.model.layers:
            layer.mlp.forward = _silu_mul_once.__get__(layer.mlp)
        self.originals = {n: m.weight.data.clone() for n, m in self._linears()}
        self.prompts = build_prompts(model_path, num_prompts)
        self.gen_len, self.chunk = gen_len, chunk
        self.seqs = self._generate()
        self.ref_top, self.ref_lp = None, None
        self.ref_top, self.ref_lp = self.forced()
        self.ref_margin = self.margin
        self.hessians: dict[str, torch.Tensor] = {}
        self.amax: dict[str, torch.Tensor] = {}  # per projection input: amax per column over calibration text

    @torch.no_grad()
    def calibrate(self, prompts: list[list[int]]) -> None:
        """X^T X of every projection's input (and of the down projection's block-Hadamard-rotated input)
        over the bf16 model's greedy continuations of `prompts` (texts the measured prompts do not use)."""
        saved = self.prompts, self.seqs
        self.prompts = prompts
        self.seqs = self._generate()
        hooks = []

        def hook(key: str):
            def fn(mod: torch.nn.Module, inp: tuple[torch.Tensor, ...]) -> None:
                x = inp[0].float().reshape(-1, inp[0].shape[-1])
                x = x[self._valid.reshape(-1)]
                self.hessians[key] = self.hessians.get(key, 0) + x.t() @ x
                amax = x.abs().amax(0)
                self.amax[key] = torch.maximum(self.amax[key], amax) if key in self.amax else amax
                if key.endswith("down_proj"):
                    xr = x @ block_hadamard(x.shape[1]).t()
                    self.hessians[key + "@rot"] = self.hessians.get(key + "@rot", 0) + xr.t() @ xr
            return fn

        for n, m in self._linears():
            hooks.append(m.register_forward_pre_hook(hook(n.split(".")[0] + "." + n.split(".")[-1])))
        for i in range(0, len(self.seqs), self.chunk):
            seqs = self.seqs[i:i + self.chunk]
            width = max(map(len, seqs))
            self._valid = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.bool)
            self.model.model(input_ids=torch.tensor([s + [2] * (width - len(s)) for s in seqs]))
        for h in hooks:
            h.remove()
        self.calib_tokens = sum(map(len, self.seqs))
        self.prompts, self.seqs = saved

    def _linears(self) -> list[tuple[str, torch.nn.Module]]:
        return [(n, m) for n, m in self.model.model.layers.named_modules()
                if isinstance(m, torch.nn.Linear | EmulatedLinear)]

    @torch.no_grad()
    def _generate(self) -> list[list[int]]:
        out = []
        for i in range(0, len(self.prompts), self.chunk):
            batch = self.prompts[i:i + self.chunk]
            width = max(map(len, batch))
            ids = torch.tensor([[2] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            self.model.generation_config.eos_token_id = None
            gen = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.gen_len,
                                      do_sample=False, pad_token_id=2)
            out += [p + gen[j, width:].tolist() for j, p in enumerate(batch)]
        return out

    @torch.no_grad()
    def forced(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per prompt and position: argmax and the logprob of the reference's argmax (or its own)."""
        tops, lps, margins = [], [], []
        for i in range(0, len(self.seqs), self.chunk):
            seqs, prompts = self.seqs[i:i + self.chunk], self.prompts[i:i + self.chunk]
            width = max(map(len, seqs))
            ids = torch.tensor([s + [2] * (width - len(s)) for s in seqs])
            hidden = self.model.model(input_ids=ids).last_hidden_state
            pos = torch.stack([torch.arange(len(p) - 1, len(p) - 1 + self.gen_len) for p in prompts])
            h = hidden.gather(1, pos[:, :, None].expand(-1, -1, hidden.shape[-1]))
            logp = self.model.lm_head(h).float().log_softmax(-1)
            top = logp.argmax(-1)
            tok = top if self.ref_top is None else self.ref_top[i:i + self.chunk]
            best2 = logp.topk(2, dim=-1).values
            tops.append(top)
            lps.append(logp.gather(2, tok[:, :, None]).squeeze(2))
            margins.append(best2[..., 0] - best2[..., 1])
        self.margin = torch.cat(margins)
        return torch.cat(tops), torch.cat(lps)

    def apply(self, variant: dict[str, Any]) -> None:
        """Every projection back to bf16, then the variant's groups replaced by their emulation."""
        rot_down = variant.get("rot_down", False)
        alpha, smooth_groups = variant.get("smooth"), variant.get("smooth_groups", ())
        first = {"qkv": "q_proj", "o": "o_proj", "gate_up": "gate_proj", "down": "down_proj"}
        for layer_idx, layer in enumerate(self.model.model.layers):
            smooth = {}
            if alpha is not None:  # one s per group input, from every weight of the group
                for group in smooth_groups:
                    parent = "mlp" if group in ("gate_up", "down") else "self_attn"
                    w = torch.cat([self.originals[f"{layer_idx}.{parent}.{n}"] for n in GROUPS[group]])
                    smooth[group] = smooth_factors(self.amax[f"{layer_idx}.{first[group]}"], w, alpha)
            for parent in (layer.self_attn, layer.mlp):
                for group, names in GROUPS.items():
                    for name in names:
                        if not hasattr(parent, name):
                            continue
                        w = self.originals[f"{layer_idx}.{'self_attn' if parent is layer.self_attn else 'mlp'}.{name}"]
                        if group in variant and layer_idx not in variant.get("bf16_layers", ()):
                            act, wmode = variant[group]
                            rot = block_hadamard(w.shape[1]) if (rot_down and name == "down_proj") else None
                            key = f"{layer_idx}.{name}"
                            setattr(parent, name, EmulatedLinear(w, act, wmode, rot, ratios=RATIOS,
                                                                 hessian=self.hessians.get(key + ("@rot" if rot is not None else "")),
                                                                 smooth=smooth.get(group)))
                        else:
                            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
                            lin.weight.data = w
                            setattr(parent, name, lin)

    def score(self, top: torch.Tensor, lp: torch.Tensor) -> dict[str, Any]:
        agree = (top == self.ref_top).float()
        d = (lp - self.ref_lp).abs()
        return {"top1_agreement": float(agree.mean()), "mean_abs_logprob_diff": float(d.mean()),
                "max_abs_logprob_diff": float(d.max()), "disagreements": int((agree == 0).sum()),
                "disagreements_at_near_ties": int(((agree == 0) & (self.ref_margin < 0.5)).sum())}


def rotation_gains(hx: Harness) -> dict[str, list[float]]:
    """Per group and layer, sum_i |W_i|^2 E[x_i^2] / (E|x|^2 mean_i |W_i|^2): the activation rounding error
    energy (e4m3's error is relative, E[dx_i^2] ~ c x_i^2) without a rotation over what a random orthogonal
    rotation of the input (QuaRot, Hadamard) would leave (c |x|^2 spread evenly over the columns). Above 1 a
    rotation would help that input; below 1 it would hurt."""
    first = {"qkv": "q_proj", "o": "o_proj", "gate_up": "gate_proj", "down": "down_proj"}
    out: dict[str, list[float]] = {}
    for group, names in GROUPS.items():
        parent = "mlp" if group in ("gate_up", "down") else "self_attn"
        gains = []
        for i in range(len(hx.model.model.layers)):
            h = torch.diag(hx.hessians[f"{i}.{first[group]}"])
            w = torch.cat([hx.originals[f"{i}.{parent}.{n}"].float() for n in names])
            col = w.square().sum(0)
            gains.append(round(float((col * h).sum() / (h.sum() * col.mean())), 3))
        out[group] = gains
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.model_path:
        path = args.model_path
    else:
        from runtime.default_model import ensure_default_model

        path = str(ensure_default_model())
    t0 = time.perf_counter()
    hx = Harness(path, args.num_prompts, args.gen_len, args.chunk)
    print(f"reference ready in {time.perf_counter() - t0:.0f} s", flush=True)
    results: dict[str, Any] = {"model": path.rstrip("/").split("/")[-1], "prompts": len(hx.prompts),
                               "gen_len": args.gen_len, "variants": {}}
    hx.model.float()
    hx.originals = {k: v.float() for k, v in hx.originals.items()}
    hx.apply({})
    results["variants"]["float32_no_fp8 (noise floor)"] = hx.score(*hx.forced())
    hx.model.to(torch.bfloat16)
    hx.originals = {k: v.to(torch.bfloat16) for k, v in hx.originals.items()}
    hx.apply({})
    wanted = args.variants.split(",") if args.variants else None
    if any("gptq" in k or "hmse" in k or "smooth" in k for k in VARIANTS if not wanted or any(w in k for w in wanted)):
        from transformers import AutoTokenizer

        texts = [t.format(c) for t in CALIB_TEMPLATES for c in CALIB_TOPICS]
        try:
            tok = AutoTokenizer.from_pretrained(path)
            calib = [tok(t)["input_ids"] for t in texts]
        except (OSError, ValueError):  # a tokenizer-less checkpoint: ids the fallback prompts never use
            calib = [[400 + (11 * i + 17 * j) % 300 for j in range(10 + i % 9)] for i in range(len(texts))]
        hx.calibrate(calib)
        results["calibration"] = {"texts": len(texts), "tokens": hx.calib_tokens}
        results["rotation_gain_per_layer"] = rotation_gains(hx)
        print(f"calibrated on {hx.calib_tokens} tokens", flush=True)
    for label, variant in VARIANTS.items():
        if wanted and not any(w in label for w in wanted):
            continue
        t0 = time.perf_counter()
        hx.apply(variant)
        res = hx.score(*hx.forced())
        res["seconds"] = time.perf_counter() - t0
        results["variants"][label] = res
        print(f"{label}: top-1 {res['top1_agreement']:.4f}, mean |dlogp| {res['mean_abs_logprob_diff']:.4f} "
              f"({res['seconds']:.0f} s)", flush=True)
    rows = [(k, f"{v['top1_agreement']:.4f} / {v['mean_abs_logprob_diff']:.4f}") for k, v in results["variants"].items()]
    print_table("FP8 weight error sources (top-1 agreement / mean |logprob diff|)", rows)
    if args.output_file:
        write_result(args.output_file, "fp8_weight_error_sources", results, vars(args),
                     argv=sys.argv if argv is None else ["bench_fp8_weight_error_sources.py", *argv])
    return results


if __name__ == "__main__":
    main()
