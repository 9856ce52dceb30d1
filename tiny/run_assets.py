"""Everything the tiny CPU run needs, built locally: a tokenizer, a random model with one MTP
layer (MODELS: a MiMo-style Qwen2 trunk, a DeepSeek-V3-shaped one with MLA, MoE and a next-n
layer, or a GLM-4.5-shaped one with GQA and the same MoE), the tiny task's prompts, and a short
supervised warm-up.

`prepare(out)` writes OUT/base (the random checkpoint), OUT/task.jsonl (rollout.tiny_task) and
OUT/warm (the warmed-up checkpoint the RL run starts from). The warm-up teaches a format, not the
task: the response is one random token repeated, so the policy still picks its first token at
random (the reward, which only looks at that first token, stays at chance level for RL to raise),
while the rest of a response is predictable and the MTP layer (trained alongside, through
megatron's MTP block for either family, unless `warm_mtp` is off) learns to draft it.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from typing import Any, Optional

from rollout.tiny_task import PROMPT_FORMAT, write_tiny_task
from tiny.checkpoints import add_mimo_mtp, build_tiny_model
from trainer_bridge.batch import TrainBatch

# Under specrl's loggers, whose INFO lines the console prints (specrl.console.setup_logging).
logger = logging.getLogger("specrl.tiny_run")

LOG_LINES = 8  # warm-up progress lines, spread over the steps

TASK_PROMPTS = 256  # prompts in the tiny task's file (64 rollouts of 4)


def _mimo(out: str, seed: int) -> None:
    build_tiny_model(out, arch="qwen2", num_layers=2, seed=seed)
    add_mimo_mtp(out, seed=seed + 1)


# The MoE models' size: 2 trunk layers and one next-n layer over tiny.checkpoints'
# DEEPSEEK_V3_TINY (MLA with a query bottleneck) or GLM4_MOE_TINY: 8 routed experts and a shared
# one, layer 0 dense (first_k_dense_replace=1), layer 1 and the next-n layer MoE
# (build_checkpoint's keywords; tests build the same models).
MOE_RUN: dict[str, Any] = dict(num_layers=2, extra_config={"num_nextn_predict_layers": 1})


def _deepseek_v3(out: str, seed: int) -> None:
    build_tiny_model(out, arch="deepseek_v3", seed=seed, **MOE_RUN)


def _glm4_5(out: str, seed: int) -> None:
    # GQA with qkv bias, q/k norms and partial rotary; grouped sigmoid routing.
    build_tiny_model(out, arch="glm4_moe", seed=seed, **MOE_RUN)


# The tiny run's model families (scripts/run-tiny-cpu.sh MODEL=...): a random checkpoint with
# one MTP layer, written to a directory with its tokenizer.
MODELS: dict[str, Callable[[str, int], None]] = {
    "mimo": _mimo,
    "deepseek-v3": _deepseek_v3,
    "glm4.5": _glm4_5,
}


def warmup_batch(
    tokenizer: Any, letters: list[str], size: int, response_len: int, rng: random.Random
) -> TrainBatch:
    """Prompts of the task with responses `t t t ...` for a random non-special token t."""
    first_normal = len(tokenizer.all_special_ids)
    prompts = [tokenizer(PROMPT_FORMAT.format(letter=letter))["input_ids"] for letter in letters]
    tokens, lengths = [], []
    for _ in range(size):
        prompt = rng.choice(prompts)
        token = rng.randrange(first_normal, len(tokenizer))
        tokens.append(prompt + [token] * response_len)
        lengths.append(response_len)
    return TrainBatch(tokens, lengths, rewards=[0.0] * size)


def prepare(
    out: str,
    steps: int = 60,
    batch_size: int = 32,
    response_len: int = 4,
    lr: float = 3e-3,
    seed: int = 0,
    drift_at: Optional[int] = None,
    model: str = "mimo",
    warm_mtp: bool = True,
    long_tail: bool = False,
) -> str:
    """Build the assets under `out`; returns the warmed-up checkpoint's path. `drift_at`,
    `long_tail`: the task's drift and long-tailed variants (rollout.tiny_task.write_tiny_task);
    the warm-up is the same. `model`:
    a key of MODELS. `warm_mtp` False leaves the MTP layer as built (random, frozen during the
    warm-up), for online MTP training to teach from scratch."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from trainer_bridge.actor import TrainActor
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    hf_logging.disable_progress_bar()  # a bar per one-file checkpoint written is only noise
    base, warm = os.path.join(out, "base"), os.path.join(out, "warm")
    MODELS[model](base, seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    letters = write_tiny_task(
        os.path.join(out, "task.jsonl"),
        tokenizer,
        n=TASK_PROMPTS,
        seed=seed,
        drift_at=drift_at,
        long_tail=long_tail,
    )
    args = TrainerArgs(
        hf_checkpoint=base,
        lr=lr,
        micro_batch_size=batch_size,
        seed=seed,
        enable_mtp_training=warm_mtp,
        mtp_loss_scaling_factor=1.0,
    )
    actor = TrainActor(args)
    rng = random.Random(seed)
    every = max(1, steps // LOG_LINES)
    for step in range(steps):
        metrics = actor.train_sft(warmup_batch(tokenizer, letters, batch_size, response_len, rng))
        if step % every == 0 or step == steps - 1:
            mtp = metrics.get("train/mtp_loss")
            logger.info(
                "warm-up step %d/%d: loss %.3f%s",
                step + 1,
                steps,
                metrics["train/loss"],
                "" if mtp is None else f", mtp loss {mtp:.3f}",
            )
    actor.save_hf(warm)
    destroy_model_parallel()
    return warm
