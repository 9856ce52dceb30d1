"""Push weights from a training loop into a running Engine, without restarting it.

    python examples/weight_update/train_and_update.py [--model-path DIR] [--steps 4]

A plain torch/transformers loop stands in for the trainer (in an RL run it is megatron-core,
and scripts/train.py does this push after every rollout). After a few steps the new weights go
to the engine with `update_weights_from_tensor` under a new `weight_version`, as with
`sglang.Engine.update_weights_from_tensor`; then the engine's checksums are compared with the
trainer's tensors, and its greedy output with the trained model's own `generate`.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spec_engine import Engine
from spec_engine.weights.loader import tensor_checksum
from tiny.checkpoints import build_tiny_model

PROMPT = "The cat"
# What the model is trained to say after PROMPT: a target the generation will visibly move to.
TARGET_TEXT = " sees the red bird and the red bird sees the cat."
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


def train(model: torch.nn.Module, input_ids: torch.Tensor, steps: int, lr: float) -> list[float]:
    """A few steps of next-token cross-entropy on one sequence; returns the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int]) -> list[int]:
    """The trained model's own greedy continuation: what the engine must now generate."""
    input_ids = torch.tensor([prompt_ids], device="cpu")
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids, device="cpu"),
            max_new_tokens=GREEDY["max_new_tokens"],
            min_new_tokens=GREEDY["max_new_tokens"],  # = ignore_eos for a fixed length
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="HF checkpoint + tokenizer (default: a tiny Llama)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or build_tiny_model(f"{tmp}/tiny-llama")
        tokenizer = AutoTokenizer.from_pretrained(path)
        # The trainer: an ordinary HF model, in float32 like the engine below.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        # float32 on the CPU, so the engine holds the trainer's tensors bit for bit.
        with Engine(model_path=path, dtype="float32", device="cpu", random_seed=0) as engine:
            before = engine.generate(prompt=PROMPT, sampling_params=GREEDY)
            print(f"before: version={before['meta_info']['weight_version']} {before['text']!r}")

            ids = tokenizer(PROMPT + TARGET_TEXT, return_tensors="pt")["input_ids"]
            losses = train(model, ids, args.steps, args.lr)
            print(f"trained {args.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

            # HF names, as the trainer has them; detach() so the engine gets plain tensors.
            named = [(name, p.detach()) for name, p in model.named_parameters()]
            result = engine.update_weights_from_tensor(named, weight_version=f"step-{args.steps}")
            print(f"update: {result['bytes']} bytes in {result['seconds']:.3f}s")

            # The engine hashes each tensor as it holds it: equal hashes, equal weights.
            expected = {name: tensor_checksum(t) for name, t in named}
            held = engine.get_weights_checksum(list(expected))
            mismatched = [name for name in expected if held[name] != expected[name]]
            print(f"checksums match: {not mismatched} ({len(expected)} tensors)")

            after = engine.generate(prompt=PROMPT, sampling_params=GREEDY)
            print(f"after: version={after['meta_info']['weight_version']} {after['text']!r}")
            prompt_ids = tokenizer(PROMPT)["input_ids"]
            matches_hf = after["output_ids"] == hf_greedy(model, prompt_ids)
            print(f"engine greedy == trained model greedy: {matches_hf}")

    if mismatched or not matches_hf or after["output_ids"] == before["output_ids"]:
        raise SystemExit(f"weight update failed (checksum mismatches: {mismatched[:3]})")


if __name__ == "__main__":
    main()
