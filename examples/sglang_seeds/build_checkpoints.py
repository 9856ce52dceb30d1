"""Tiny local stand-ins for the hub models in SGLang's speculative-decoding commands, in the
formats those models are published in: an EAGLE-2 draft as pytorch_model.bin with a shorter
context than its target, an FR-Spec token map in a directory, an EAGLE-3 draft with its own
vocabulary, MiMo with an MTP layer, and a Qwen2.5-7B stand-in whose vocab_size is padded past
its 1.5B draft's.

    python examples/sglang_seeds/build_checkpoints.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from rollout.tiny_task import write_tiny_task
from tiny.checkpoints import (
    add_mimo_mtp,
    build_checkpoint,
    build_eagle_draft,
    build_tiny_model,
    build_tokenizer,
)


def _set_config(path: str, **values: object) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(values)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def _to_pytorch_bin(path: str) -> None:
    """Re-save a draft's weights as pytorch_model.bin, as lmsys' EAGLE drafts are published."""
    weights = os.path.join(path, "model.safetensors")
    torch.save(load_file(weights), os.path.join(path, "pytorch_model.bin"))
    os.remove(weights)


def build(out: str) -> dict[str, str]:
    """Every stand-in under `out`, by the hub name it replaces (its last path component)."""
    paths: dict[str, str] = {}

    def path(name: str) -> str:
        paths[name] = os.path.join(out, name)
        return paths[name]

    for name, seed in (
        ("Llama-2-7b-chat-hf", 0),
        ("Meta-Llama-3-8B-Instruct", 1),
        ("Llama-3.1-8B-Instruct", 2),
    ):
        build_tiny_model(path(name), "llama", seed=seed)
    eagle2 = build_eagle_draft(
        path("sglang-EAGLE-llama2-chat-7B"), paths["Llama-2-7b-chat-hf"], seed=3
    )
    _to_pytorch_bin(eagle2)
    _set_config(eagle2, max_position_embeddings=256)  # the target has 512 (SGLang PR 9388)
    build_eagle_draft(
        path("sglang-EAGLE-LLaMA3-Instruct-8B"), paths["Meta-Llama-3-8B-Instruct"], seed=4
    )
    fr_spec = path("LLaMA3-Instruct-8B-FR-Spec")
    os.makedirs(fr_spec, exist_ok=True)
    torch.save(torch.arange(256), os.path.join(fr_spec, "freq_32768.pt"))
    eagle3 = build_eagle_draft(
        path("sglang-EAGLE3-Llama-3.1-Instruct-8B"),
        paths["Llama-3.1-8B-Instruct"],
        version=3,
        draft_vocab_size=256,
        seed=5,
    )
    _set_config(eagle3, max_position_embeddings=256)
    mimo = build_tiny_model(path("MiMo-7B-RL"), "qwen2", seed=6)
    add_mimo_mtp(mimo, seed=7)
    # Qwen2.5-7B pads its embedding to 152064 rows, Qwen2.5-1.5B to 151936; one tokenizer.
    build_tiny_model(path("Qwen2.5-1.5B-Instruct"), "qwen2", seed=8, tie_word_embeddings=True)
    qwen7b = path("Qwen2.5-7B-Instruct")
    build_tokenizer(qwen7b)
    shutil.copy(os.path.join(paths["Qwen2.5-1.5B-Instruct"], "config.json"), qwen7b)
    with open(os.path.join(qwen7b, "config.json")) as f:
        small = json.load(f)
    build_checkpoint(
        qwen7b,
        "qwen2",
        vocab_size=576,
        num_layers=3,
        seed=9,
        bos_token_id=small["bos_token_id"],
        eos_token_id=small["eos_token_id"],
    )
    # Prompts for slime's --sglang-* lines (run.sh slime).
    paths["task.jsonl"] = os.path.join(out, "task.jsonl")
    write_tiny_task(paths["task.jsonl"], AutoTokenizer.from_pretrained(mimo), n=8)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    for name, p in build(parser.parse_args().out_dir).items():
        print(f"{name}: {p}")


if __name__ == "__main__":
    main()
