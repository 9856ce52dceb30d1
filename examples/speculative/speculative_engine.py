"""Speculative decoding with the in-process Engine: EAGLE-2, EAGLE-3, MTP, STANDALONE and NGRAM.

    python examples/speculative/speculative_engine.py              # builds tiny random models
    python examples/speculative/speculative_engine.py --model-path LLAMA --eagle-draft EAGLE2_DIR \\
        --eagle3-draft EAGLE3_DIR --standalone-draft SMALL_LM --mtp-model-path MIMO \\
        --algorithms EAGLE NGRAM

The keyword arguments are SGLang's `--speculative-*` flags (`sglang.Engine(...)` takes the
same). For every algorithm the greedy outputs are compared with plain decoding of the same
target: speculation is lossless, so they are equal token for token. meta_info tells how well
the draft guessed: spec_verify_ct (target verify passes) and spec_accept_length (tokens emitted
per pass, the target's own bonus token included, so 1.0 means no draft token was accepted).
Random tiny drafts almost never agree with their target (accept length ~1); NGRAM drafts from
text seen before, so it accepts many tokens on the repetitive prompt even here.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

from spec_engine import Engine
from tiny.checkpoints import add_mimo_mtp, build_checkpoint, build_eagle_draft, build_tiny_model

PROMPTS = [
    "The cat sees a bird",
    "One plus two equals",
    # Repetitive text: NGRAM finds its continuation among the tokens it has already seen.
    "red green blue red green blue red green blue red green blue red green blue",
]
# ignore_eos: the same number of tokens from every run, whatever the random model emits.
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
ALGORITHMS = ("EAGLE", "EAGLE3", "MTP", "STANDALONE", "NGRAM")


class Models:
    """Checkpoint paths by role; a role not given on the command line is built tiny and random."""

    def __init__(self, args: argparse.Namespace, root: str) -> None:
        self.root = root
        self.paths = {
            "target": args.model_path,
            "eagle": args.eagle_draft,
            "eagle3": args.eagle3_draft,
            "small": args.standalone_draft,
            "mimo": args.mtp_model_path,
        }
        self.builders: dict[str, Callable[[str], str]] = {
            # A 4-layer Llama: EAGLE-3 reads features from three different layers.
            "target": lambda out: build_tiny_model(out, arch="llama", num_layers=4),
            "eagle": lambda out: build_eagle_draft(out, self["target"], version=2),
            # A draft vocabulary of 128 hot tokens, mapped to the target's by the d2t table.
            "eagle3": lambda out: build_eagle_draft(
                out, self["target"], version=3, draft_vocab_size=128
            ),
            "small": self._small_lm,
            # MiMo = a Qwen2 trunk plus model.mtp_layers.*: the target drafts for itself.
            "mimo": lambda out: add_mimo_mtp(build_tiny_model(out, arch="qwen2")),
        }

    def __getitem__(self, role: str) -> str:
        if self.paths[role] is None:
            self.paths[role] = self.builders[role](os.path.join(self.root, role))
        return self.paths[role]

    def _small_lm(self, out: str) -> str:
        # STANDALONE needs the target's vocabulary and at least its context length.
        with open(os.path.join(self["target"], "config.json")) as f:
            target = json.load(f)
        return build_checkpoint(
            out,
            arch="llama",
            num_layers=1,
            vocab_size=target["vocab_size"],
            max_position_embeddings=target["max_position_embeddings"],
            seed=5,
        )


def speculative_config(algorithm: str, models: Models) -> tuple[str, dict[str, Any]]:
    """(target path, Engine keyword arguments) of one algorithm."""
    if algorithm == "EAGLE":
        # A draft tree: 3 steps deep, 2 candidates per step, the best 5 tokens verified at once.
        return models["target"], dict(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=models["eagle"],
            speculative_num_steps=3,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=5,
        )
    if algorithm == "EAGLE3":
        return models["target"], dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=models["eagle3"],
            speculative_num_steps=3,
            speculative_eagle_topk=1,  # topk 1: a chain of 3 drafts, 4 tokens verified
        )
    if algorithm == "MTP":
        # As in SGLang, MTP is EAGLE with no draft path: the target's MTP layer is the draft.
        return models["mimo"], dict(
            speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1
        )
    if algorithm == "STANDALONE":
        return models["target"], dict(
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=models["small"],
            speculative_num_steps=3,
            speculative_eagle_topk=1,
        )
    if algorithm == "NGRAM":
        # No draft model; the drafts come from a cache of n-grams of prompts and outputs.
        return models["target"], dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)
    raise ValueError(f"unknown algorithm {algorithm!r}; pick from {', '.join(ALGORITHMS)}")


def generate(model_path: str, **engine_kwargs: Any) -> list[dict[str, Any]]:
    """Greedy outputs for PROMPTS from a fresh engine."""
    with Engine(model_path=model_path, random_seed=0, **engine_kwargs) as engine:
        return engine.generate(prompt=PROMPTS, sampling_params=GREEDY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="Llama-family target (default: a tiny random one)")
    parser.add_argument("--eagle-draft", help="EAGLE-2 draft (LlamaForCausalLMEagle) of the target")
    parser.add_argument(
        "--eagle3-draft", help="EAGLE-3 draft (LlamaForCausalLMEagle3) of the target"
    )
    parser.add_argument("--standalone-draft", help="a small LM with the target's vocabulary")
    parser.add_argument("--mtp-model-path", help="a target with MTP layers (MiMoForCausalLM)")
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as root:
        models = Models(args, root)
        plain: dict[str, list[dict[str, Any]]] = {}  # plain decoding, by target
        for algorithm in args.algorithms:
            target, spec = speculative_config(algorithm, models)
            if target not in plain:
                plain[target] = generate(target)
            outputs = generate(target, **spec)
            lossless = [o["output_ids"] for o in outputs] == [
                p["output_ids"] for p in plain[target]
            ]
            accept = [round(o["meta_info"]["spec_accept_length"], 2) for o in outputs]
            verify = [o["meta_info"]["spec_verify_ct"] for o in outputs]
            print(
                f"{algorithm:<10} lossless={lossless} accept_length={accept} verify_ct={verify}",
                flush=True,
            )
            if not lossless:
                raise SystemExit(f"{algorithm}: greedy outputs differ from plain decoding")
        print(f"text of the last prompt: {outputs[-1]['text']!r}")


if __name__ == "__main__":
    main()
