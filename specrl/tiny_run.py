"""Everything the tiny CPU run needs, built locally: a tokenizer, a random MiMo-style model
(Qwen2 trunk + one MTP layer), the tiny task's prompts, and a short supervised warm-up.

`prepare(out)` writes OUT/base (the random checkpoint), OUT/task.jsonl (rollout.tiny_task) and
OUT/warm (the warmed-up checkpoint the RL run starts from). The warm-up teaches a format, not the
task: the response is one random token repeated, so the policy still picks its first token at
random (the reward, which only looks at that first token, stays at chance level for RL to raise),
while the rest of a response is predictable and the MTP layer (trained alongside) learns to
draft it.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any, Optional

from rollout.tiny_task import PROMPT_FORMAT, write_tiny_task
from specrl.tiny_models import add_mimo_mtp, build_tiny_model
from trainer_bridge.batch import TrainBatch

logger = logging.getLogger("specrl.tiny_run")

LOG_LINES = 8  # warm-up progress lines, spread over the steps


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
) -> str:
    """Build the assets under `out`; returns the warmed-up checkpoint's path. `drift_at`: the
    task's drift variant (rollout.tiny_task.write_tiny_task); the warm-up is the same."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from trainer_bridge.actor import TrainActor
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    hf_logging.disable_progress_bar()  # a bar per one-file checkpoint written is only noise
    base, warm = os.path.join(out, "base"), os.path.join(out, "warm")
    build_tiny_model(base, arch="qwen2", num_layers=2, seed=seed)
    add_mimo_mtp(base, seed=seed + 1)
    tokenizer = AutoTokenizer.from_pretrained(base)
    letters = write_tiny_task(
        os.path.join(out, "task.jsonl"), tokenizer, n=256, seed=seed, drift_at=drift_at
    )
    args = TrainerArgs(
        hf_checkpoint=base,
        lr=lr,
        micro_batch_size=batch_size,
        seed=seed,
        enable_mtp_training=True,
        mtp_loss_scaling_factor=1.0,
    )
    actor = TrainActor(args)
    rng = random.Random(seed)
    every = max(1, steps // LOG_LINES)
    for step in range(steps):
        metrics = actor.train_sft(warmup_batch(tokenizer, letters, batch_size, response_len, rng))
        if step % every == 0 or step == steps - 1:
            logger.info(
                "warm-up step %d/%d: loss %.3f, mtp loss %.3f",
                step + 1,
                steps,
                metrics["train/loss"],
                metrics["train/mtp_loss"],
            )
    actor.save_hf(warm)
    destroy_model_parallel()
    return warm
