"""Multi-LoRA serving: PEFT adapters stacked in fixed device buffers, one slot per adapter, so a batch
mixes base requests and several adapters in one forward (and one CUDA graph)."""
