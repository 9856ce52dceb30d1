"""What the engine reports, in SGLang's shapes: server info, loads (/v1/loads), weights by
name, slime's weights checker, and why generation cannot run now (/health_generate). Mixed
into Engine through EngineControl; everything that reads scheduler state runs on the scheduler
thread (`_call`), so counters are never read half-updated."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Optional

from spec_engine.args.sglang_compat import SGLANG_FLAGS
from spec_engine.version import __version__

if TYPE_CHECKING:
    from spec_engine.core.scheduler import Scheduler

# Server-info keys SGLang reports that no flag of either side sets (slime's external-engine
# check and SGLang's router read them).
_SERVER_INFO_CONSTANTS = {
    "encoder_only": False,
    "moe_dp_size": 1,
    "pp_size": 1,
    "status": "ready",
}
# /v1/loads?include= sections (SGLang's GetLoadsReqInput.VALID_SECTIONS).
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
# One rank: what SGLang's weights checker reports as a rank's parallelism.
_PARALLELISM = {
    "tp_rank": 0,
    "tp_size": 1,
    "dp_rank": 0,
    "dp_size": 1,
    "pp_rank": 0,
    "pp_size": 1,
    "rank": 0,
    "size": 1,
}
WEIGHTS_CHECKER_ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")


class EngineReports:
    """Needs Engine's _call, _call_command, args, scheduler, memory, updater, runner, stats,
    context_len, model_config, tokenizer and weight_version."""

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's server info: the server args at top level (specrl's, and SGLang's own with
        the values this engine runs at: its tp_size, dp_size 1, ...; the API key left out), what
        SGLang's scheduler adds (status, max_total_num_tokens, max_req_input_len), the weight
        version, and the scheduler's state in internal_states."""
        sglang = {name: flag.default for name, flag in SGLANG_FLAGS.items()}
        args = {k: v for k, v in self.args.to_dict().items() if k != "api_key"}
        return {
            **sglang,
            **self.args.sglang_options,
            **args,
            **_SERVER_INFO_CONSTANTS,
            "version": __version__,
            "context_length": self.context_len,
            "max_total_num_tokens": self.runner.max_total_tokens,
            "max_req_input_len": min(self.context_len, self.runner.max_total_tokens) - 1,
            "weight_version": self.weight_version,
            # The FP8 block of --quantization fp8 (None: unquantized): what a trainer checking
            # its pushes (--check-weight-update-equal) quantizes its weights with.
            "weight_block_size": self.runner.model.config.weight_block_size,
            "internal_states": [self._call(self._internal_state)],
        }

    def get_load(self, include: Optional[list[str]] = None) -> dict[str, Any]:
        """SGLang's /v1/loads: one entry per data-parallel rank (one here) with the core
        counters and the sections `include` asks for (default all), and their aggregate."""
        sections = set(include or ["all"])
        unknown = sorted(sections - set(LOAD_SECTIONS))
        if unknown:
            raise ValueError(
                f"unknown include section(s) {unknown}; use {', '.join(LOAD_SECTIONS)}"
            )
        load = self._call(lambda: self._load(sections))
        return {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": __version__,
            "dp_rank_count": 1,
            "loads": [load],
            "aggregate": {
                "total_running_reqs": load["num_running_reqs"],
                "total_waiting_reqs": load["num_waiting_reqs"],
                "total_reqs": load["num_total_reqs"],
                "avg_token_usage": load["token_usage"],
                "avg_throughput": load["gen_throughput"],
                "avg_utilization": load["utilization"],
            },
        }

    def _load(self, sections: set[str]) -> dict[str, Any]:
        s, stats = self.scheduler, self.stats.snapshot()
        every = "all" in sections
        waiting = s.admission.waiting
        running, total = _num_running(s), s.kv.allocator.total_tokens
        used = total - s.kv.available_tokens()
        usage = used / total
        max_running = self.args.max_running_requests
        load: dict[str, Any] = {
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": len(waiting),
            "num_used_tokens": used,
            # SGLang's: the tokens in use plus those the queue will prefill.
            "num_total_tokens": used + sum(r.seq_len for r in waiting),
            "max_total_num_tokens": total,
            "token_usage": round(usage, 4),
            "gen_throughput": round(s.last_gen_throughput, 2),
            "cache_hit_rate": round(stats["cached_tokens"] / max(stats["prompt_tokens"], 1), 4),
            "utilization": round(max(running / max_running, usage / 0.9), 4),
            "max_running_requests": max_running,
        }
        speculative = s.policy.load()
        if (every or "spec" in sections) and speculative is not None:
            load["speculative"] = speculative
        if every or "disagg" in sections:
            load["disaggregation"] = {
                "mode": "null",
                "prefill_prealloc_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            }
        if every or "queues" in sections:
            load["queues"] = {
                "waiting": len(waiting),
                "grammar": 0,
                "paused": running + len(waiting) if self.memory.paused else 0,
                "retracted": sum(1 for r in waiting if r.retractions),
            }
        load["num_total_reqs"] = running + len(waiting)
        return load

    def _internal_state(self) -> dict[str, Any]:
        s = self.scheduler
        free, total = s.kv.available_tokens(), s.kv.allocator.total_tokens
        return {
            "num_used_tokens": total - free,
            "num_running_reqs": _num_running(s),
            "num_waiting_reqs": len(s.admission.waiting),
            "token_usage": round(1.0 - free / total, 4),
            "num_retractions": s.retraction.num_retractions,
            "last_gen_throughput": s.last_gen_throughput,
            **s.policy.report(),  # speculation's counters, alarm and cost model
        }

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": None if self.tokenizer is None else self.args.tokenizer_path,
            "is_generation": True,
            "architecture": self.model_config.architecture,
            "weight_version": self.weight_version,
        }

    def get_weight_version(self) -> str:
        return self.weight_version

    def generation_blocked(self) -> Optional[str]:
        """Why generation cannot run now (paused, or memory released), or None."""

        def reason() -> Optional[str]:
            if self.memory.paused:
                return "generation is paused; continue_generation resumes it"
            missing = sorted(self.memory.released - {"cuda_graph"})
            if missing:
                return (
                    f"memory is released ({', '.join(missing)}); resume_memory_occupation "
                    "restores it"
                )
            return None

        return self._call(reason)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` values of a weight, flattened, as the engine holds it (at
        --tp-size > 1 the whole tensor, gathered from the ranks, as SGLang's)."""
        if truncate_size < 0:
            raise ValueError(f"truncate_size must be >= 0, got {truncate_size}")
        return self._call_command("_weights_by_name", name, truncate_size)

    def _weights_by_name(self, name: str, truncate_size: int) -> list:
        self.memory.require_weights()
        tensor = self.updater.tensor(name)
        return tensor.reshape(-1)[:truncate_size].float().tolist()

    def weights_checker(
        self,
        action: str = "checksum",
        allow_quant_error: bool = False,
        skip_tensor_list: Optional[list[str]] = None,
    ) -> dict[str, Any]:
        """SGLang's weights checker (slime's --check-weight-update-equal): "snapshot" the
        weights' checksums; "reset_tensors" fills every weight with NaN (so what a following
        update leaves untouched shows, and cannot serve unnoticed); "compare" with the snapshot
        (success false, HTTP 400, naming the tensors that differ); "checksum" reports SHA-256
        per tensor as SGLang's "ranks" / "per_engine_checksum". Tensors whose name contains an
        entry of skip_tensor_list are neither reset nor compared. allow_quant_error is accepted:
        the comparison is exact (an FP8 engine's snapshot and update hold the same quantized
        values). At --tp-size > 1 every rank runs it and the checksums are of the whole
        tensors, gathered (one entry in "ranks", for the engine)."""
        if action not in WEIGHTS_CHECKER_ACTIONS:
            raise ValueError(
                f"weights_checker action must be one of {', '.join(WEIGHTS_CHECKER_ACTIONS)}, "
                f"got {action!r}"
            )
        return self._call_command("_check_weights", action, skip_tensor_list or [])

    def _check_weights(self, action: str, skip: list[str]) -> dict[str, Any]:
        """weights_checker's `action` on this rank (the collectives inside run on every rank)."""

        def checked(checksums: dict[str, str]) -> dict[str, str]:
            return {n: c for n, c in checksums.items() if not any(p in n for p in skip)}

        self.memory.require_weights()
        if action == "snapshot":
            self._weight_snapshot = checked(self.updater.checksums(None))
            return {"success": True, "message": f"{len(self._weight_snapshot)} weights"}
        if action == "reset_tensors":
            kept = [
                (n, self.updater.tensor(n).clone())
                for n in self.updater.names()
                if any(p in n for p in skip)
            ]
            self.updater.fill_weights(float("nan"))
            self.updater.apply(kept)
            self.scheduler.weights_changed(flush=True)
            return {"success": True, "message": f"weights reset to NaN ({len(kept)} kept)"}
        current = checked(self.updater.checksums(None))
        if action == "checksum":
            return _checksum_report(current)
        if self._weight_snapshot is None:
            raise ValueError("weights_checker compare needs a snapshot first")
        differ = sorted(k for k, v in current.items() if self._weight_snapshot.get(k) != v)
        if differ:
            return {
                "success": False,
                "message": f"check tensor equality failed: {len(differ)} weights differ "
                f"from the snapshot: {differ[:10]}",
            }
        return {"success": True, "message": f"{len(current)} weights equal the snapshot"}


def _num_running(s: Scheduler) -> int:
    """Running requests, a half-prefilled (chunked) one included."""
    return len(s.active_reqs())


def _checksum_report(checksums: dict[str, str]) -> dict[str, Any]:
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(name.encode())
        digest.update(checksums[name].encode())
    per_gpu = digest.hexdigest()
    return {
        "success": True,
        "message": f"{len(checksums)} weights (sha256 of each tensor's bytes)",
        "ranks": [
            {"checksums": checksums, "per_gpu_checksum": per_gpu, "parallelism_info": _PARALLELISM}
        ],
        "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest(),
    }
