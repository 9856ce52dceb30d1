"""Prompt data: a JSONL file read in epochs, optionally shuffled, tokenized on demand."""

from __future__ import annotations

import json
import logging
import random
from typing import Any, Optional

from rollout.sample import Sample

logger = logging.getLogger(__name__)


class DataSource:
    """Serves prompts as Samples (prompt, prompt token ids, label, metadata), wrapping epochs.

    Each epoch is a permutation of the file's lines: the file order, or with `shuffle` a
    permutation seeded by (seed, epoch), so a resumed run sees the same order.

    The buffer (slime's RolloutDataSourceWithBuffer) holds groups handed back to be continued
    (--partial-rollout): the rollout takes them before new prompts, and a checkpoint keeps them.
    """

    def __init__(
        self,
        path: str,
        tokenizer: Any,
        input_key: str = "input",
        label_key: Optional[str] = None,
        metadata_key: str = "metadata",
        apply_chat_template: bool = False,
        shuffle: bool = False,
        seed: int = 42,
    ) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self.input_key = input_key
        self.label_key = label_key
        self.metadata_key = metadata_key
        self.apply_chat_template = apply_chat_template
        self.shuffle = shuffle
        self.seed = seed
        numbered = _read_jsonl(path)
        for line, record in numbered:
            self._check(line, record)
        self.records = [record for _, record in numbered]
        self.epoch = 0
        self.offset = 0  # position within the current epoch's order
        self._order = self._epoch_order(0)
        self.buffer: list[list[Sample]] = []

    @classmethod
    def from_args(
        cls, args: Any, tokenizer: Any, path: Optional[str] = None, shuffle: Optional[bool] = None
    ) -> DataSource:
        """The prompt data of RolloutArgs (`path`/`shuffle` override it, e.g. for eval sets)."""
        path = path if path is not None else args.prompt_data
        if path is None:
            raise ValueError(
                "no prompt data: set --prompt-data to a JSONL file (or --rollout-function-path / "
                "--load-debug-rollout-data to roll out without one)"
            )
        return cls(
            path,
            tokenizer,
            input_key=args.input_key,
            label_key=args.label_key,
            metadata_key=args.metadata_key,
            apply_chat_template=args.apply_chat_template,
            shuffle=args.rollout_shuffle if shuffle is None else shuffle,
            seed=args.rollout_seed,
        )

    def __len__(self) -> int:
        return len(self.records)

    def get_prompts(self, n: int) -> list[Sample]:
        """The next `n` prompts, continuing into the next epoch when this one runs out."""
        prompts = []
        for _ in range(n):
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            prompts.append(self._make_sample(self.records[self._order[self.offset]]))
            self.offset += 1
        return prompts

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Hand groups back to be served again, after those already in the buffer."""
        self.buffer.extend(groups)

    def get_samples_from_buffer(self, n: int) -> list[list[Sample]]:
        """Up to `n` groups from the buffer, oldest first (slime's pop_first)."""
        groups, self.buffer = self.buffer[:n], self.buffer[n:]
        return groups

    def all_prompts(self) -> list[Sample]:
        """Every prompt once, in file order (for evaluation); does not move the epoch position."""
        return [self._make_sample(record) for record in self.records]

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, offset into its order) and what the order is derived from: with
        the same file, shuffle and seed, an epoch's permutation is recomputed on load; and the
        buffer's groups, as plain values (JSON)."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "num_prompts": len(self.records),
            "buffer": [[sample.to_dict() for sample in group] for group in self.buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, offset = state["epoch"], state["offset"]
        saved = (state.get("shuffle", self.shuffle), state.get("seed", self.seed))
        if saved != (self.shuffle, self.seed):
            raise ValueError(
                f"the checkpoint's prompt order was --rollout-shuffle {saved[0]} with "
                f"--rollout-seed {saved[1]}, this run has {self.shuffle} and {self.seed}; resume "
                "with the same flags"
            )
        count = state.get("num_prompts", len(self.records))
        # A file grown by appending, read in file order and still in its first epoch, continues
        # exactly as a run on the longer file from the start would have (a longer run's prompts
        # added after the checkpoint); a shuffle or a later epoch would read another order.
        grown = count < len(self.records) and not self.shuffle and epoch == 0
        if (count != len(self.records) and not grown) or not 0 <= offset <= count:
            raise ValueError(
                f"the checkpoint was saved reading {count} prompts (offset {offset}, epoch "
                f"{epoch}), {self.path} has {len(self.records)}; resume with the prompt file it "
                "was saved with (a file grown by appending resumes only unshuffled in its first "
                "epoch)"
            )
        if grown:
            logger.info(
                "%s has %d prompts, %d when the checkpoint was saved: reading on from prompt %d",
                self.path,
                len(self.records),
                count,
                offset,
            )
        self.epoch, self.offset = epoch, offset
        self._order = self._epoch_order(epoch)
        self.buffer = [[Sample.from_dict(d) for d in group] for group in state.get("buffer", [])]

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _check(self, line: int, record: Any) -> None:
        where = f"{self.path} line {line}"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if self.input_key not in record:
            raise ValueError(
                f"{where} has no key {self.input_key!r} (keys: {', '.join(record)}); set "
                "--input-key"
            )
        if self.label_key is not None and self.label_key not in record:
            raise ValueError(
                f"{where} has no key {self.label_key!r} (keys: {', '.join(record)}); set "
                "--label-key"
            )
        prompt = record[self.input_key]
        if isinstance(prompt, list):
            if not self.apply_chat_template:
                raise ValueError(
                    f"{where}: the prompt is a list of chat messages; pass --apply-chat-template"
                )
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
                raise ValueError(
                    f"{where}: chat messages must be objects with 'role' and 'content'"
                )
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(
                f"{where}: the prompt under {self.input_key!r} must be a non-empty string or a "
                "list of "
                f"chat messages, got {prompt!r}"
            )
        if not isinstance(record.get(self.metadata_key) or {}, dict):
            raise ValueError(
                f"{where}: {self.metadata_key!r} must be a JSON object, got "
                f"{record[self.metadata_key]!r}"
            )

    def _make_sample(self, record: dict[str, Any]) -> Sample:
        prompt = record[self.input_key]
        if self.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            # The template already holds any BOS/role tokens it wants.
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            text = prompt
            ids = self.tokenizer(text)["input_ids"]
        metadata = record.get(self.metadata_key) or {}
        label = record[self.label_key] if self.label_key is not None else None
        return Sample(prompt=text, tokens=list(ids), label=label, metadata=dict(metadata))


def _read_jsonl(path: str) -> list[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line."""
    records = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append((line_no, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {line_no} is not valid JSON: {e}") from e
    if not records:
        raise ValueError(
            f"{path} holds no prompts; give a JSONL file with one JSON object per line"
        )
    return records
