"""Rollout metrics (docs/design.md's keys) and a logger: metrics.jsonl always, wandb and
tensorboard optionally."""

from __future__ import annotations

import json
import math
import numbers
import os
import statistics
from typing import Any, Optional

from rollout.sample import Sample, Status


def rollout_metrics(
    groups: list[list[Sample]], rollout_time: float, response_tokens: Optional[int] = None
) -> dict[str, float]:
    """rollout/* over the kept samples and perf/*; `response_tokens` is every response token the
    engines produced (dropped and aborted groups too), default: the kept samples' tokens.

    rollout/spec_accept_length is SGLang's count, tokens emitted per verify pass (accepted draft
    tokens plus the bonus token), summed over samples before dividing; spec_accept_rate is
    accepted / drafted tokens (both absent when no sample verified); spec_accept_alarm is 1.0
    when the engine's acceptance alarm was up for any sample's weights. All are absent without
    speculative decoding.

    perf/rollout_tail_time is the long tail: seconds from the first to the last finished response
    among the kept samples that finished in this rollout (Sample.finish_time; absent when none
    did).
    """
    samples = [s for group in groups for s in group]
    metrics = sample_metrics(samples, "rollout")
    metrics.update(spec_metrics(samples))
    finished = [s.finish_time for s in samples if s.finish_time is not None]
    if finished:
        metrics["perf/rollout_tail_time"] = max(finished) - min(finished)
    tokens = sum(s.response_length for s in samples) if response_tokens is None else response_tokens
    metrics["perf/rollout_time"] = rollout_time
    metrics["perf/tokens_per_s"] = tokens / rollout_time if rollout_time > 0 else 0.0
    return metrics


def sample_metrics(samples: list[Sample], prefix: str) -> dict[str, float]:
    """{prefix}/raw_reward, {prefix}/response_len/{mean,median,max,min},
    {prefix}/truncated_ratio."""
    if not samples:
        return {}
    lengths = [s.response_length for s in samples]
    metrics = {
        f"{prefix}/response_len/mean": statistics.fmean(lengths),
        f"{prefix}/response_len/median": float(statistics.median(lengths)),
        f"{prefix}/response_len/max": float(max(lengths)),
        f"{prefix}/response_len/min": float(min(lengths)),
        f"{prefix}/truncated_ratio": sum(s.status is Status.TRUNCATED for s in samples)
        / len(samples),
    }
    rewards = [s.reward for s in samples if s.reward is not None]
    if rewards:
        metrics[f"{prefix}/raw_reward"] = statistics.fmean(rewards)
    return metrics


def staleness_metrics(groups: list[list[Sample]], trained_version: int) -> dict[str, float]:
    """rollout/weight_version_lag/{mean,max}: how stale the trained tokens are, in weight
    versions: `trained_version` (the policy the trainer updates) less the version that generated
    each response token that enters the loss (loss_mask 1; Sample.token_weight_versions). 0 under
    synchronous training; above 0 for the earlier tokens of samples --partial-rollout continued,
    unless --mask-offpolicy-in-partial-rollout masks them. Samples without per-token versions
    (a custom generate function may not record them) are left out; absent when no token is
    left, or a version is not an integer (engines labelled other than by the launcher)."""
    lags = []
    for sample in (s for group in groups for s in group):
        versions = sample.token_weight_versions
        if versions is None:
            continue
        mask = sample.loss_mask or [1] * len(versions)
        try:
            lags += [trained_version - int(v) for v, m in zip(versions, mask) if m]
        except ValueError:
            return {}
    if not lags:
        return {}
    return {
        "rollout/weight_version_lag/mean": statistics.fmean(lags),
        "rollout/weight_version_lag/max": float(max(lags)),
    }


def spec_metrics(samples: list[Sample]) -> dict[str, float]:
    infos = [s.spec_info for s in samples if s.spec_info]
    if not infos:
        return {}
    # 1.0 when any sample came from weights under which the engine's accept length had
    # collapsed (spec_engine.speculative.accept_alarm; engines without the field count as 0). Also
    # when no sample verified: with --speculative-on-collapse disable a whole rollout can run
    # plainly, and that is when the alarm matters most.
    metrics = {
        "rollout/spec_accept_alarm": max(float(i.get("spec_accept_alarm", 0.0)) for i in infos)
    }
    verify = sum(i["spec_verify_ct"] for i in infos)
    if verify:
        accepted = sum(i["spec_accept_token_num"] for i in infos)
        drafted = sum(i["spec_draft_token_num"] for i in infos)
        metrics["rollout/spec_accept_length"] = (accepted + verify) / verify
        metrics["rollout/spec_accept_rate"] = accepted / drafted if drafted else 0.0
    return metrics


class MetricsLogger:
    """`log(step, metrics)` to `output_dir/metrics.jsonl` (one JSON object per call, with "step"
    and "rollout_id", both the step), and to wandb and/or tensorboard when asked. wandb runs
    offline unless WANDB_MODE is set.

    Resuming (`resume_step`, the first step this run logs): metrics.jsonl is appended to, never
    truncated (readers take each step's last line: specrl.plots.read_metrics), wandb continues
    run `wandb_run_id`, and tensorboard drops the events the interrupted run logged from
    `resume_step` on, so its step axis continues."""

    def __init__(
        self,
        output_dir: str,
        use_wandb: bool = False,
        wandb_project: Optional[str] = None,
        wandb_run_name: Optional[str] = None,
        config: Optional[dict[str, Any]] = None,
        use_tensorboard: bool = False,
        wandb_run_id: Optional[str] = None,
        resume_step: Optional[int] = None,
    ) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = open(self.path, "a")  # a resumed run adds to what the killed one wrote
        self._wandb_run = None
        self._tb_writer = None
        if use_wandb:
            os.environ.setdefault(
                "WANDB_MODE", "offline"
            )  # never reach the network unless the user asks
            try:
                import wandb
            except ImportError as e:
                raise ImportError(
                    "use_wandb needs wandb: pip install wandb (or log without it: "
                    f"{self.path} is always written)"
                ) from e
            self._wandb_run = wandb.init(
                project=wandb_project or "specrl",
                name=wandb_run_name,
                dir=output_dir,
                config=config,
                id=wandb_run_id,
                resume="allow" if wandb_run_id is not None else None,
            )
        if use_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "use_tensorboard needs tensorboard: pip install tensorboard (or log without "
                    "it: "
                    f"{self.path} is always written)"
                ) from e
            self._tb_writer = SummaryWriter(
                log_dir=os.path.join(output_dir, "tensorboard"), purge_step=resume_step
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        values = {}
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                if hasattr(value, "item"):  # torch / numpy scalars
                    value = value.item()
                else:
                    raise TypeError(f"metric {key!r} is {value!r}; metrics must be numbers")
            values[key] = float(value)
        # JSON has no NaN/inf; keep the line parseable and the key present.
        record = {
            "step": step,
            "rollout_id": step,
            **{k: (v if math.isfinite(v) else None) for k, v in values.items()},
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)
        if self._tb_writer is not None:
            for key, value in values.items():
                self._tb_writer.add_scalar(key, value, step)

    def log_series(self, step: int, name: str, series: dict[str, list]) -> None:
        """A time series of one step (e.g. BatchSizeTrace.to_dict()) as a line of
        `output_dir/{name}.jsonl`, appended as metrics.jsonl is: readers take each step's last
        line (specrl.plots.read_metrics)."""
        with open(os.path.join(self.output_dir, f"{name}.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "rollout_id": step, **series}) + "\n")

    def close(self) -> None:
        self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._tb_writer is not None:
            self._tb_writer.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
