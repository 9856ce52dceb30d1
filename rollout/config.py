"""RolloutArgs: the rollout flags (slime's names and defaults), their CLI and their validation.

The dataclass is the single source of truth: `add_cli_args` generates `--rollout-batch-size`
style flags from it (help text from field metadata) and `from_cli_args` builds it back from a
parsed namespace. `__post_init__` checks values and names the flag to change.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

from rollout.rewards import REWARD_TYPES
from spec_engine.args.dataclass_cli import add_dataclass_args, dataclass_from_args

REQUIRED = dataclasses.MISSING


def _opt(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field carrying its CLI help (and optional `choices`/`metavar`)."""
    if default is REQUIRED:
        return field(metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class RolloutArgs:
    """Rollout options. Names and defaults follow slime's where slime has the option."""

    # Batch shape
    rollout_batch_size: int = _opt(
        REQUIRED,
        "Prompts (groups) per rollout; each prompt is sampled --n-samples-per-prompt times.",
    )
    n_samples_per_prompt: int = _opt(1, "Responses sampled per prompt (the group size for GRPO).")
    # Data
    prompt_data: Optional[str] = _opt(
        None,
        "JSONL file of prompts, one JSON object per line.",
        unset="none; generating a rollout needs it",
    )
    input_key: str = _opt(
        "input",
        "Key of the prompt in each JSONL object: a string, or a list of chat messages with "
        "--apply-chat-template.",
    )
    label_key: Optional[str] = _opt(
        None,
        "Key of the label (reference answer) in each JSONL object.",
        unset="none: samples carry no label",
    )
    metadata_key: str = _opt(
        "metadata",
        "Key of an optional per-prompt metadata object, copied into every sample's metadata.",
    )
    apply_chat_template: bool = _opt(
        False,
        "Wrap each prompt as a user message and apply the tokenizer's chat template "
        "(add_generation_prompt=True).",
    )
    rollout_shuffle: bool = _opt(
        False,
        "Shuffle the prompts, afresh every epoch (deterministic from --rollout-seed and the "
        "epoch).",
    )
    rollout_seed: int = _opt(
        42,
        "Seed for prompt shuffling and for each sample's sampling_seed (derived from the seed and "
        "the sample's index), so a rollout repeats exactly.",
    )
    # Sampling
    rollout_max_response_len: int = _opt(
        1024, "Most tokens generated per response (max_new_tokens); longer responses end TRUNCATED."
    )
    rollout_temperature: float = _opt(1.0, "Sampling temperature (0 is greedy).")
    rollout_top_p: float = _opt(1.0, "Top-p (nucleus) sampling; 1.0 is off.")
    rollout_top_k: int = _opt(-1, "Top-k sampling; -1 is off.")
    rollout_stop: Optional[list[str]] = _opt(
        None,
        "Stop strings: a response ends (COMPLETED) at the first one.",
        unset="none: EOS and --rollout-max-response-len end a response",
    )
    rollout_stop_token_ids: Optional[list[int]] = _opt(
        None, "Stop token ids, in addition to the model's EOS.", unset="none: EOS only"
    )
    rollout_skip_special_tokens: bool = _opt(
        False, "Drop special tokens from response text (the token ids keep them)."
    )
    # Over-sampling and dynamic sampling
    over_sampling_batch_size: Optional[int] = _opt(
        None,
        "Prompts submitted at a time while fewer than --rollout-batch-size groups are kept or in "
        "flight (default: --rollout-batch-size). Groups still in flight when enough are kept are "
        "aborted.",
    )
    dynamic_sampling_filter_path: Optional[str] = _opt(
        None,
        "Import path of a group filter `def f(args, samples: list[Sample]) -> bool` (False drops "
        "the group), e.g. rollout.filters.check_reward_nonzero_std.",
        unset="none: every group is kept",
    )
    dynamic_sampling_max_groups: Optional[int] = _opt(
        None,
        "Most groups one rollout may submit while groups are dropped (by the dynamic filter, or "
        "because a sample was aborted or failed); past it the rollout fails (default: 10 x "
        "--rollout-batch-size).",
    )
    # Partial rollouts
    partial_rollout: bool = _opt(
        False,
        "Keep the groups still unfinished when a rollout has --rollout-batch-size groups (and "
        "those that finish after it): they go back to the data buffer with their partial "
        "tokens and log-probs and are continued, not restarted, first thing in the next rollout "
        "under the new weights (slime's --partial-rollout).",
    )
    mask_offpolicy_in_partial_rollout: bool = _opt(
        False,
        "With --partial-rollout, mask from the loss the tokens a continued sample got in earlier "
        "rollouts (older weights): only the tokens of the weights being trained count.",
    )
    # Extension points
    rollout_function_path: Optional[str] = _opt(
        None,
        "Import path of a function replacing the whole rollout: `[async] def f(args, rollout_id, "
        "manager) -> list[list[Sample]]` (manager: the RolloutManager, with data_source, router, "
        "tokenizer, reward_fn).",
        unset="the built-in over-sampling rollout",
    )
    custom_generate_function_path: Optional[str] = _opt(
        None,
        "Import path of a per-sample generate function: `async def f(args, sample, "
        "sampling_params, engine) -> Sample`; engine has `await "
        "engine.async_generate(input_ids=..., sampling_params=..., return_logprob=True)` (routed "
        "and abortable) and the function fills tokens, response, response_length, loss_mask, "
        "rollout_log_probs and status.",
        unset="the built-in rollout.generate.generate",
    )
    custom_rm_path: Optional[str] = _opt(
        None,
        "Import path of a reward function `[async] def rm(args, sample) -> float`, used instead of "
        "--rm-type.",
        unset="none: --rm-type's reward",
    )
    rm_type: Optional[str] = _opt(
        None,
        "Built-in reward: exact_match (response == label after trimming), boxed_math (last "
        "\\boxed{...} vs label, numbers compared by value), tiny (the tiny CPU task; see "
        "rollout.tiny_task).",
        choices=REWARD_TYPES,
        unset="none: --custom-rm-path's; generating a rollout needs one of the two",
    )
    # Debug data
    save_debug_rollout_data: Optional[str] = _opt(
        None,
        "Save every rollout to this path (must contain {rollout_id}) as torch.save({'rollout_id', "
        "'samples': [Sample.to_dict()]}).",
        unset="none: not saved",
    )
    load_debug_rollout_data: Optional[str] = _opt(
        None,
        "Load rollouts saved by --save-debug-rollout-data instead of generating ({rollout_id} is "
        "filled in when present).",
        unset="none: rollouts are generated",
    )
    # Evaluation
    eval_prompt_data: Optional[list[str]] = _opt(
        None,
        "Evaluation sets as name/path pairs: --eval-prompt-data aime /data/aime.jsonl gsm8k "
        "/data/gsm8k.jsonl.",
        metavar="NAME/PATH",
        unset="none: no evaluation",
    )
    eval_interval: Optional[int] = _opt(
        None,
        "Evaluate every N rollouts (the launcher runs RolloutManager.eval).",
        unset="none: no evaluation",
    )
    n_samples_per_eval_prompt: int = _opt(1, "Responses sampled per evaluation prompt.")
    eval_max_response_len: Optional[int] = _opt(
        None, "max_new_tokens for evaluation (default: --rollout-max-response-len)."
    )
    eval_temperature: Optional[float] = _opt(
        None, "Temperature for evaluation (default: --rollout-temperature)."
    )
    eval_top_p: Optional[float] = _opt(None, "Top-p for evaluation (default: --rollout-top-p).")

    def __post_init__(self) -> None:
        _at_least("rollout_batch_size", self.rollout_batch_size, 1)
        _at_least("n_samples_per_prompt", self.n_samples_per_prompt, 1)
        _at_least("rollout_max_response_len", self.rollout_max_response_len, 1)
        _at_least("rollout_seed", self.rollout_seed, 0)
        _at_least("n_samples_per_eval_prompt", self.n_samples_per_eval_prompt, 1)
        for name in (
            "over_sampling_batch_size",
            "dynamic_sampling_max_groups",
            "eval_max_response_len",
            "eval_interval",
        ):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        for name in ("rollout_temperature", "eval_temperature"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{_flag(name)} must be >= 0 (0 is greedy), got {value}")
        for name in ("rollout_top_p", "eval_top_p"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value <= 1.0:
                raise ValueError(f"{_flag(name)} must be in (0, 1], got {value}")
        if self.rollout_top_k == 0 or self.rollout_top_k < -1:
            raise ValueError(f"--rollout-top-k must be -1 (off) or >= 1, got {self.rollout_top_k}")
        if self.rm_type is not None and self.rm_type not in REWARD_TYPES:
            raise ValueError(
                f"--rm-type must be one of {', '.join(REWARD_TYPES)}, got {self.rm_type!r}; "
                "for your own reward use --custom-rm-path"
            )
        if self.rm_type is not None and self.custom_rm_path is not None:
            raise ValueError(
                f"give one of --rm-type ({self.rm_type}) or --custom-rm-path "
                f"({self.custom_rm_path}), not both"
            )
        if (
            self.save_debug_rollout_data is not None
            and "{rollout_id}" not in self.save_debug_rollout_data
        ):
            raise ValueError(
                f"--save-debug-rollout-data {self.save_debug_rollout_data!r} must contain "
                "{rollout_id} "
                "so rollouts do not overwrite each other, e.g. /tmp/rollout_{rollout_id}.pt"
            )
        if self.eval_prompt_data is not None and (
            not self.eval_prompt_data or len(self.eval_prompt_data) % 2
        ):
            raise ValueError(
                f"--eval-prompt-data takes name/path pairs, got {self.eval_prompt_data}"
            )
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise ValueError(
                "--mask-offpolicy-in-partial-rollout masks the tokens of continued samples; it "
                "needs --partial-rollout"
            )
        if self.partial_rollout and self.rollout_function_path is not None:
            raise ValueError(
                f"--partial-rollout continues the built-in rollout's groups; the rollout of "
                f"--rollout-function-path {self.rollout_function_path} keeps its own (use "
                "manager.data_source.add_samples there)"
            )

    @property
    def over_sampling_size(self) -> int:
        """Prompts submitted at a time (over_sampling_batch_size, else rollout_batch_size)."""
        return self.over_sampling_batch_size or self.rollout_batch_size

    @property
    def max_groups(self) -> int:
        """Most groups one rollout may submit under a dynamic filter."""
        return self.dynamic_sampling_max_groups or 10 * self.rollout_batch_size

    @property
    def eval_datasets(self) -> list[tuple[str, str]]:
        """(name, path) pairs of --eval-prompt-data."""
        data = self.eval_prompt_data or []
        return list(zip(data[::2], data[1::2]))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _at_least(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{_flag(name)} must be an integer >= {minimum}, got {value!r}")


# ---------------------------------------------------------------- CLI generation


def add_cli_args(parser: argparse.ArgumentParser, exclude: Iterable[str] = ()) -> None:
    """Add one flag per RolloutArgs field (`--rollout-batch-size`, ...; booleans are switches)."""
    add_dataclass_args(parser, RolloutArgs, "rollout options (RolloutArgs)", exclude=exclude)


def from_cli_args(namespace: argparse.Namespace, **overrides: Any) -> RolloutArgs:
    """Build RolloutArgs from flags added by `add_cli_args`; `overrides` win."""
    return dataclass_from_args(RolloutArgs, namespace, **overrides)
