"""The policy as megatron-core builds it: a Hugging Face config to megatron's TransformerConfig and
GPTModel (provider.py), with DeepSeek's multi-latent attention (mla.py), mixture-of-experts
options and balance losses (moe.py), and Transformer Engine's checkpoint names on the local layer
spec (checkpoint_names.py)."""
