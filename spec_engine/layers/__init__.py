"""Model building blocks: attention, rotary, norms, embeddings/head, sampler."""
