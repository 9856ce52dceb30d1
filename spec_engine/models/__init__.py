"""Model definitions (no runtime concerns), the registry that picks one by architecture name,
and the Hugging Face config reader the engine and the trainer share (hf_config.py)."""
