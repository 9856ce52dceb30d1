"""The engine's control API: weight updates, memory release, pause and profiling, with
SGLang's request fields (io_struct's UpdateWeights*/InitWeightsUpdateGroup/... ReqInput).
Engine inherits it; every call runs on the scheduler thread between steps (`_call`; on every
rank of a tensor-parallel engine what changes its state: `_call_command`). A field
SGLang has that specrl does not act on is accepted at its neutral value and refused otherwise
with the reason. SGLang's extra fields come after the original parameters, which callers may
pass by position. The wrappers (HTTP routes, the rollout's Ray actor) are generated from
control_methods.CONTROL_METHODS with these signatures; weights.formats decodes the tensors."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

import torch

from spec_engine.reports import EngineReports
from spec_engine.weights.formats import FLATTENED_BUCKET, named_tensor_pairs
from spec_engine.weights.transport import materialize


class AfterUpdate(NamedTuple):
    """What every weight update does once the weights are in (SGLang's request fields)."""

    flush_cache: bool
    weight_version: Optional[str]
    abort_all_requests: bool
    torch_empty_cache: bool


class EngineControl(EngineReports):
    """Mixed into Engine: needs its _call, args, scheduler, memory, updater, runner and
    weight_version."""

    def update_weights_from_tensor(
        self,
        named_tensors: Any = None,
        load_format: Optional[str] = None,
        flush_cache: bool = True,
        weight_version: Optional[str] = None,
        serialized_named_tensors: Optional[list[Union[str, bytes]]] = None,
        abort_all_requests: bool = False,
        disable_draft_model: Optional[bool] = None,
        torch_empty_cache: bool = False,
    ) -> dict[str, Any]:
        """Load Hugging Face-named tensors (target, MTP layers, or `draft.`-prefixed external
        draft tensors). named_tensors: a list of (name, tensor) pairs, a dict, or with
        load_format="flattened_bucket" FlattenedBucket objects / their dicts (one per dtype).
        Tensors may also be torch.multiprocessing reduce_tensor handles (CUDA IPC). Or, instead,
        serialized_named_tensors: SGLang's form from a process on this machine, one
        MultiprocessingSerializer string per tensor-parallel rank (rank r opens entry r), whose
        tensors are shared, not copied (CUDA IPC; see weights.transport.serialize_shared). At
        --tp-size > 1 every rank takes its blocks, once every rank's checks passed."""
        if disable_draft_model:
            raise ValueError(
                "disable_draft_model: specrl updates the draft with the target (an MTP draft "
                "shares the target's names); leave out the 'draft.'-prefixed tensors instead"
            )
        if load_format not in (None, FLATTENED_BUCKET):
            raise ValueError(
                f"load_format must be null or 'flattened_bucket', got {load_format!r} (specrl "
                "loads Hugging Face-named tensors; 'direct' parameter names are not supported)"
            )
        after = AfterUpdate(flush_cache, weight_version, abort_all_requests, torch_empty_cache)
        shared = None
        if serialized_named_tensors is not None:
            if named_tensors is not None:
                raise ValueError("give named_tensors or serialized_named_tensors, not both")
            entries = serialized_named_tensors
            ranks = self.args.tp_size
            if not isinstance(entries, list) or len(entries) != ranks:
                count = len(entries) if isinstance(entries, list) else type(entries).__name__
                raise ValueError(
                    "serialized_named_tensors must hold one entry per tensor-parallel rank of the "
                    f"engine, and this engine has {ranks}; got {count}"
                )
            if ranks > 1:  # SGLang's way: rank r opens entry r (made for its device)
                return self._call_command("_update_from_tensors", None, entries, load_format, after)
            shared = entries[0]
        items = named_tensor_pairs(named_tensors, load_format, shared)
        if self.args.tp_size > 1:
            # Every rank takes its blocks of the whole tensors, broadcast from here (host copies).
            whole = [(name, materialize(value).cpu()) for name, value in items]
            return self._call_command("_update_from_tensors", whole, None, None, after)
        return self._update_weights(lambda: self.updater.apply(items), after)

    def _update_from_tensors(
        self,
        items: Optional[list[tuple[str, Any]]],
        entries: Optional[list[Union[str, bytes]]],
        load_format: Optional[str],
        after: AfterUpdate,
    ) -> dict[str, Any]:
        """A tensor update on every rank: of `items` (whole tensors), or of this rank's entry of
        `entries` (serialized_named_tensors)."""

        def load() -> int:
            pairs = items
            if entries is not None:
                mine = entries[self.tp.rank]
                pairs = self.updater.on_every_rank(
                    lambda: named_tensor_pairs(None, load_format, mine)
                )
            return self.updater.apply(pairs)

        return self._apply_update(load, after)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: Optional[str] = None,
    ) -> dict[str, Any]:
        """Join the trainer's process group (the trainer is rank 0) for
        update_weights_from_distributed: engine rank r as rank `rank_offset` + r (SGLang's and
        slime's numbering; world_size counts every engine rank). backend: "nccl" (SGLang's
        default, on CUDA) or "gloo"; unset, the engine's device decides."""
        if backend is None:
            backend = "nccl" if self.runner.device.type == "cuda" else "gloo"
        self._call_command(
            "updater.init_group",
            master_address,
            master_port,
            rank_offset,
            world_size,
            group_name,
            backend,
        )
        ranks = self.args.tp_size
        where = (
            f"rank {rank_offset}"
            if ranks == 1
            else f"ranks {rank_offset}..{rank_offset + ranks - 1}"
        )
        return {
            "success": True,
            "message": f"joined {group_name!r} ({backend}) as {where} of {world_size}",
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
        abort_all_requests: bool = False,
        torch_empty_cache: bool = False,
    ) -> dict[str, Any]:
        """Receive one broadcast per named tensor from the group's rank 0, then load them
        (dtypes as torch dtypes or their names, "bfloat16"; load_format as SGLang: None). At
        --tp-size > 1 every rank receives the whole tensors and takes its blocks, once every
        rank's checks passed."""
        if load_format is not None:
            raise ValueError(
                f"load_format {load_format!r} is not supported for distributed updates; send "
                "null (the tensors are broadcast as they are)"
            )
        after = AfterUpdate(flush_cache, weight_version, abort_all_requests, torch_empty_cache)
        return self._call_command(
            "_update_from_distributed", names, dtypes, shapes, group_name, after
        )

    def _update_from_distributed(
        self, names: list[str], dtypes: list, shapes: list, group_name: str, after: AfterUpdate
    ) -> dict[str, Any]:
        return self._apply_update(
            lambda: self.updater.from_distributed(names, dtypes, shapes, group_name), after
        )

    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: Optional[str] = None,
        component: str = "target",
        flush_cache: bool = True,
        load_format: Optional[str] = None,
        abort_all_requests: bool = False,
        is_async: bool = False,
        torch_empty_cache: bool = False,
        keep_pause: bool = False,
        recapture_cuda_graph: bool = False,
        token_step: int = 0,
        manifest: Optional[dict] = None,
    ) -> dict[str, Any]:
        """Load a Hugging Face checkpoint: into the target (and its MTP layers), or with
        component="draft" into the external draft. load_format: SGLang's auto, safetensors or pt
        (the files present decide). keep_pause leaves generation paused after the update
        (continue_generation resumes it); recapture_cuda_graph captures the graphs again
        (never needed: updates copy into the tensors the graphs read); token_step (the trainer's
        step) is accepted as a label SGLang keeps and specrl has no use for. At --tp-size > 1
        every rank reads and checks its blocks, and none copies unless all checks pass."""
        if load_format not in (None, "auto", "safetensors", "pt"):
            raise ValueError(
                f"load_format {load_format!r} is not supported; specrl reads safetensors and "
                "pytorch_model.bin checkpoints (auto, safetensors, pt)"
            )
        if is_async:
            raise ValueError(
                "is_async: specrl updates weights synchronously (the call returns once they "
                "serve); send false"
            )
        if manifest is not None:
            raise ValueError(
                "manifest: specrl reads the checkpoint's own index; send null (the whole "
                "checkpoint is loaded)"
            )

        # A Command: every rank of a tensor-parallel engine loads its blocks.
        after = AfterUpdate(flush_cache, weight_version, abort_all_requests, torch_empty_cache)
        return self._call_command(
            "_update_from_disk", model_path, component, recapture_cuda_graph, keep_pause, after
        ) | {"num_paused_requests": 0}

    def _update_from_disk(
        self,
        model_path: str,
        component: str,
        recapture_cuda_graph: bool,
        keep_pause: bool,
        after: AfterUpdate,
    ) -> dict[str, Any]:
        def load() -> int:
            received = self.updater.from_disk(model_path, component)
            if component == "target":  # get_model_info names it from now on, as SGLang does
                self.model_path = model_path
            if recapture_cuda_graph:
                self.memory.recapture_graphs()
            if keep_pause:
                self.memory.pause("in_place")
            return received

        return self._apply_update(load, after)

    def _update_weights(self, load: Callable[[], int], after: AfterUpdate) -> dict[str, Any]:
        return self._call(lambda: self._apply_update(load, after))

    def _apply_update(self, load: Callable[[], int], after: AfterUpdate) -> dict[str, Any]:
        """Run `load` between steps, then what every update does (on the scheduler thread)."""
        self.memory.require_weights()
        if after.abort_all_requests:
            self.scheduler.abort_all("aborted for a weight update (abort_all_requests)")
        start = time.perf_counter()
        received = load()
        self.scheduler.weights_changed(flush=after.flush_cache)
        if after.weight_version is not None:
            self.weight_version = after.weight_version
        self.scheduler.policy.weights_updated(self.weight_version)
        if after.torch_empty_cache:
            _empty_device_cache(self.runner.device)
        seconds = time.perf_counter() - start
        return {
            "success": True,
            "message": f"weights updated: {received} bytes in {seconds:.3f} s",
            "bytes": received,
            "seconds": seconds,
            "weight_version": self.weight_version,
        }

    def get_weights_checksum(self, names: Optional[list[str]] = None) -> dict[str, str]:
        """SHA-256 of each named tensor as the engine holds it (see
        weights.loader.tensor_checksum); at --tp-size > 1 of the whole tensor, gathered."""
        return self._call_command("_checksums", names)

    def _checksums(self, names: Optional[list[str]]) -> dict[str, str]:
        self.memory.require_weights()
        return self.updater.checksums(names)

    def pause_generation(self, mode: str = "abort") -> dict[str, str]:
        """Stop generating: abort (end requests), retract (re-queue them) or in_place (keep
        them)."""
        self._call_command("memory.pause", mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, torch_empty_cache: bool = True) -> dict[str, str]:
        self._call_command("_continue_generation", torch_empty_cache)
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _continue_generation(self, torch_empty_cache: bool) -> None:
        if torch_empty_cache:
            _empty_device_cache(self.runner.device)
        self.memory.unpause()

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Free weights and/or the KV cache (tags "weights", "kv_cache", "cuda_graph"; all by
        default) until resume_memory_occupation; generation waits meanwhile."""
        self._call_command("memory.release", tags)

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        self._call_command("memory.resume", tags)

    def flush_cache(self) -> bool:
        """Drop the prefix cache. Refused (False) while requests are queued or running, unless
        paused."""
        return self._call_command("memory.flush_cache")

    def update_weight_version(
        self, new_version: str, abort_all_requests: bool = True
    ) -> dict[str, Any]:
        """Relabel the loaded weights (SGLang's /update_weight_version; it aborts the requests in
        flight unless abort_all_requests is false)."""
        if not isinstance(new_version, str) or not new_version:
            raise ValueError(f"new_version must be a non-empty string, got {new_version!r}")
        self._call_command("_relabel", new_version, abort_all_requests)
        return {
            "success": True,
            "message": f"Weight version updated to {new_version}",
            "new_version": new_version,
        }

    def _relabel(self, new_version: str, abort_all_requests: bool) -> None:
        if abort_all_requests:
            self.scheduler.abort_all("aborted by update_weight_version")
        self.weight_version = new_version
        self.scheduler.policy.relabel(new_version)

    def post_process_weights(
        self, restore_weights_before_load: bool = False, post_process_quantization: bool = False
    ) -> dict[str, Any]:
        """slime's hook around updates of quantized (compressed-tensors) weights: specrl's
        weights are unquantized, or FP8 (--quantization fp8) quantized as each update arrives,
        so there is nothing to restore or re-quantize afterwards."""
        return {
            "success": True,
            "message": "weights quantized as they arrive: nothing to post-process",
        }

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]:
        self._call_command("updater.destroy_group", group_name)
        return {"success": True, "message": f"left weight update group {group_name!r}"}

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
        are accepted as SGLang's and not used: the trace spans start to stop. A tensor-parallel
        engine profiles rank 0."""
        return self._call(
            lambda: self._profiler_ctl.start(output_dir, activities, with_stack, record_shapes)
        )

    def stop_profile(self) -> dict[str, Any]:
        return self._call(self._profiler_ctl.stop)


def _empty_device_cache(device: torch.device) -> None:
    """SGLang's torch_empty_cache: hand cached CUDA blocks back to the driver (nothing to do
    off CUDA)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
