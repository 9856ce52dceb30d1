"""The engine's control API: weight updates, memory release, pause, and what SGLang's
server reports (server info, loads, weight version, profiling). Engine inherits it; every
call runs on the scheduler thread between steps (`_call`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional, Union

from spec_engine.args.sglang_compat import SGLANG_FLAGS
from spec_engine.version import __version__
from spec_engine.weights.transport import FlattenedBucket, deserialize_shared

# Server-info keys SGLang reports that no flag of either side sets (slime's external-engine
# check and SGLang's router read them).
_SERVER_INFO_CONSTANTS = {
    "encoder_only": False,
    "enable_return_routed_experts": False,
    "moe_dp_size": 1,
    "pp_size": 1,
}


class EngineControl:
    """Mixed into Engine: needs its _call, args, scheduler, memory, updater, runner and
    weight_version."""

    def update_weights_from_tensor(
        self,
        named_tensors: Any = None,
        load_format: Optional[str] = None,
        flush_cache: bool = True,
        weight_version: Optional[str] = None,
        serialized_named_tensors: Optional[list[Union[str, bytes]]] = None,
    ) -> dict[str, Any]:
        """Load Hugging Face-named tensors (target, MTP layers, or `draft.`-prefixed external
        draft tensors). named_tensors: a list of (name, tensor) pairs, a dict, or with
        load_format="flattened_bucket" FlattenedBucket objects / their dicts (one per dtype).
        Tensors may also be torch.multiprocessing reduce_tensor handles (CUDA IPC). Or, instead,
        serialized_named_tensors: SGLang's form from a process on this machine, one
        MultiprocessingSerializer string per tensor-parallel rank (one here), whose tensors are
        shared, not copied (CUDA IPC; see weights.transport.serialize_shared)."""
        if serialized_named_tensors is not None:
            if named_tensors is not None:
                raise ValueError("give named_tensors or serialized_named_tensors, not both")
            entries = serialized_named_tensors
            if not isinstance(entries, list) or len(entries) != 1:
                count = len(entries) if isinstance(entries, list) else type(entries).__name__
                raise ValueError(
                    "serialized_named_tensors must hold one entry per tensor-parallel rank of the "
                    f"engine, and specrl engines have one; got {count}"
                )
            named_tensors = deserialize_shared(serialized_named_tensors[0])
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format must be None or 'flattened_bucket', got {load_format!r}")
        if load_format == "flattened_bucket":
            buckets = named_tensors if isinstance(named_tensors, list) else [named_tensors]
            if not all(isinstance(b, (FlattenedBucket, dict)) for b in buckets):
                raise ValueError(
                    "load_format='flattened_bucket' takes FlattenedBucket objects or their "
                    "to_dict() dicts"
                )
            items = [
                pair
                for b in buckets
                for pair in (
                    b if isinstance(b, FlattenedBucket) else FlattenedBucket.from_dict(b)
                ).unpack()
            ]
        elif isinstance(named_tensors, dict):
            items = list(named_tensors.items())
        elif isinstance(named_tensors, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in named_tensors
        ):
            items = list(named_tensors)
        else:
            raise ValueError("named_tensors must be a dict or a list of (name, tensor) pairs")
        return self._update_weights(lambda: self.updater.apply(items), flush_cache, weight_version)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> dict[str, Any]:
        """Join the trainer's process group (the trainer is rank 0) for
        update_weights_from_distributed."""
        self._call(
            lambda: self.updater.init_group(
                master_address, master_port, rank_offset, world_size, group_name, backend
            )
        )
        return {
            "success": True,
            "message": f"joined {group_name!r} as rank {rank_offset} of {world_size}",
        }

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list,
        shapes: list,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: Optional[str] = None,
        load_format: Optional[str] = None,
    ) -> dict[str, Any]:
        """Receive one broadcast per named tensor from the group's rank 0, then load them
        (dtypes as torch dtypes or their names, "bfloat16"; load_format as SGLang: None)."""
        if load_format is not None:
            raise ValueError(
                f"load_format {load_format!r} is not supported for distributed updates; send "
                "null (the tensors are broadcast as they are)"
            )
        return self._update_weights(
            lambda: self.updater.from_distributed(names, dtypes, shapes, group_name),
            flush_cache,
            weight_version,
        )

    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: Optional[str] = None,
        component: str = "target",
        flush_cache: bool = True,
        load_format: Optional[str] = None,
    ) -> dict[str, Any]:
        """Load a Hugging Face checkpoint: into the target (and its MTP layers), or with
        component="draft" into the external draft. load_format: SGLang's auto, safetensors or pt
        (the files present decide)."""
        if load_format not in (None, "auto", "safetensors", "pt"):
            raise ValueError(
                f"load_format {load_format!r} is not supported; specrl reads safetensors and "
                "pytorch_model.bin checkpoints (auto, safetensors, pt)"
            )
        return self._update_weights(
            lambda: self.updater.from_disk(model_path, component), flush_cache, weight_version
        )

    def _update_weights(
        self, load: Callable[[], int], flush_cache: bool, weight_version: Optional[str]
    ) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            self.memory.require_weights()
            start = time.perf_counter()
            received = load()
            self.scheduler.weights_changed(flush=flush_cache)
            if weight_version is not None:
                self.weight_version = weight_version
            return {
                "success": True,
                "bytes": received,
                "seconds": time.perf_counter() - start,
                "weight_version": self.weight_version,
            }

        return self._call(run)

    def get_weights_checksum(self, names: Optional[list[str]] = None) -> dict[str, str]:
        """SHA-256 of each named tensor as the engine holds it (see
        weights.loader.tensor_checksum)."""

        def checksums() -> dict[str, str]:
            self.memory.require_weights()
            return self.updater.checksums(names)

        return self._call(checksums)

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating: abort (end requests), retract (re-queue them) or in_place (keep
        them)."""
        self._call(lambda: self.memory.pause(mode))

    def continue_generation(self) -> None:
        self._call(self.memory.unpause)

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Free weights and/or the KV cache (tags "weights", "kv_cache", "cuda_graph"; all by
        default) until resume_memory_occupation; generation waits meanwhile."""
        self._call(lambda: self.memory.release(tags))

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        self._call(lambda: self.memory.resume(tags))

    def flush_cache(self) -> bool:
        """Drop the prefix cache. Refused (False) while requests are queued or running, unless
        paused."""
        return self._call(self.memory.flush_cache)

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's server info: the server args at top level (specrl's, and SGLang's own with
        the values this engine runs at: tp_size 1, ...; the API key left out), sizes, the
        weight version, and the scheduler's state in internal_states."""
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
            "weight_version": self.weight_version,
            "internal_states": [self._call(self._internal_state)],
        }

    def get_load(self) -> dict[str, Any]:
        """SGLang's /v1/loads: one entry per data-parallel rank (one here) and their sum."""
        state = self._call(self._internal_state)
        running, waiting = state["num_running_reqs"], state["num_waiting_reqs"]
        load = {
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting,
            "num_used_tokens": state["num_used_tokens"],
            "num_total_tokens": self.runner.max_total_tokens,
            "token_usage": state["token_usage"],
            "gen_throughput": state["last_gen_throughput"],
        }
        return {
            "timestamp": time.time(),
            "version": __version__,
            "dp_rank_count": 1,
            "loads": [load],
            "aggregate": {
                "total_running_reqs": running,
                "total_waiting_reqs": waiting,
                "total_reqs": running + waiting,
                "avg_token_usage": load["token_usage"],
                "total_throughput": load["gen_throughput"],
            },
        }

    def get_weight_version(self) -> str:
        return self.weight_version

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> None:
        """Relabel the loaded weights (SGLang's /update_weight_version)."""
        if not isinstance(new_version, str) or not new_version:
            raise ValueError(f"new_version must be a non-empty string, got {new_version!r}")

        def run() -> None:
            if abort_all_requests:
                self.scheduler.abort_all("aborted by update_weight_version")
            self.weight_version = new_version

        self._call(run)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` values of a weight, flattened, as the engine holds it."""
        if truncate_size < 0:
            raise ValueError(f"truncate_size must be >= 0, got {truncate_size}")

        def read() -> list:
            self.memory.require_weights()
            tensor = self.updater.tensor(name)
            return tensor.reshape(-1)[:truncate_size].float().tolist()

        return self._call(read)

    def weights_checker(self, action: str) -> dict[str, Any]:
        """slime's --check-weight-update-equal: "snapshot" the weights' checksums, "reset_tensors"
        (fill every weight with NaN, so a partial update shows), "compare" with the snapshot."""

        def run() -> dict[str, Any]:
            self.memory.require_weights()
            if action == "snapshot":
                self._weight_snapshot = self.updater.checksums(None)
                return {"success": True, "message": f"{len(self._weight_snapshot)} weights"}
            if action == "reset_tensors":
                self.updater.fill_weights(float("nan"))
                self.scheduler.weights_changed(flush=True)
                return {"success": True, "message": "weights reset to NaN"}
            if action == "compare":
                if self._weight_snapshot is None:
                    raise ValueError("weights_checker compare needs a snapshot first")
                current = self.updater.checksums(None)
                differ = sorted(k for k, v in current.items() if self._weight_snapshot.get(k) != v)
                return {
                    "success": not differ,
                    "message": f"{len(differ)} weights differ from the snapshot: {differ[:10]}",
                }
            raise ValueError(
                f"weights_checker action must be snapshot, reset_tensors or compare, got {action!r}"
            )

        return self._call(run)

    def post_process_weights(
        self, restore_weights_before_load: bool = False, post_process_quantization: bool = False
    ) -> dict[str, Any]:
        """slime's hook around updates of quantized (compressed-tensors) weights: specrl holds
        unquantized weights, so there is nothing to restore or re-quantize."""
        return {"success": True, "message": "unquantized weights: nothing to post-process"}

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._call(lambda: self.updater.destroy_group(group_name))

    def start_profile(
        self,
        output_dir: Optional[str] = None,
        num_steps: Optional[int] = None,
        activities: Optional[list[str]] = None,
        with_stack: Optional[bool] = None,
        record_shapes: Optional[bool] = None,
        start_step: Optional[int] = None,
        profile_by_stage: bool = False,
    ) -> dict[str, Any]:
        """Start torch.profiler on the scheduler thread; stop_profile writes a Chrome trace to
        output_dir (SGLANG_TORCH_PROFILER_DIR, else /tmp). num_steps/start_step/profile_by_stage
        are accepted as SGLang's and not used: the trace spans start to stop."""
        return self._call(
            lambda: self._profiler_ctl.start(output_dir, activities, with_stack, record_shapes)
        )

    def stop_profile(self) -> dict[str, Any]:
        return self._call(self._profiler_ctl.stop)

    def _internal_state(self) -> dict[str, Any]:
        s = self.scheduler
        state = {
            "num_used_tokens": s.allocator.total_tokens - s.available_tokens(),
            "num_running_reqs": len(s.running),
            "num_waiting_reqs": len(s.waiting),
            "token_usage": round(1.0 - s.available_tokens() / s.allocator.total_tokens, 4),
            "num_retractions": s.num_retractions,
            "last_gen_throughput": s.last_gen_throughput,
        }
        if self.args.speculative_algorithm is not None:
            state["avg_spec_accept_length"] = (
                s.spec_emitted / s.spec_verify_ct if s.spec_verify_ct else None
            )
            state["spec_verify_ct"] = s.spec_verify_ct
            state["spec_time_breakdown"] = dict(s.worker.timings.seconds)
        return state

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": None if self.tokenizer is None else self.args.tokenizer_path,
            "is_generation": True,
            "architecture": self.model_config.architecture,
            "weight_version": self.weight_version,
        }
