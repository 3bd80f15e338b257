"""Model definitions (Llama family). Built from ModelConfig + a ParallelContext; called by the ModelRunner."""
