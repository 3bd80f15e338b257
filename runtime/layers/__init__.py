"""Model building blocks (tensor-parallel linear/embedding, norm, rotary, attention, logits, sampler).
Called by models; they call attention backends and kernels below them."""
