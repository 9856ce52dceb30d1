"""The shims megatron-core 0.16.1 needs to run on CPU with gloo, and process-group set-up.

megatron-core assumes CUDA in a handful of places that the CPU path reaches. `apply_cpu_shims()`
patches exactly those, once, and only when CUDA is absent (so GPU runs are untouched); each patch
below says what fails without it. The patches only change behaviour that would otherwise raise
("Torch not compiled with CUDA enabled"), so code that already runs on CPU is unaffected.
`init_model_parallel()` / `destroy_model_parallel()` (or the `model_parallel()` context) set up
torch.distributed (gloo) and megatron's parallel_state for one process or one spawned rank.
`filter_known_warnings()` silences megatron-core's warnings that no run can act on.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

_applied = False
CPU = torch.device("cpu")

# Warnings from megatron-core that no run can act on, as (category, message start, issuing
# module, only without CUDA). Transformer Engine and Apex cannot be installed without CUDA, nor
# does CUDA_DEVICE_MAX_CONNECTIONS mean anything there, so those notices only matter on GPUs;
# "full" is TransformerConfig's own default cuda_graph_scope; megatron's own layers call the
# tp_group helper with tp_group=None and the collective torch deprecates (torch's wrapper issues
# that one); dist_checkpointing loads through torch's ShardedTensor and load_state_dict, both
# deprecated by torch.
MEGATRON = r"megatron\.core\."
KNOWN_WARNINGS = (
    (UserWarning, "Transformer Engine and Apex are not installed", MEGATRON, True),
    (UserWarning, "Apex is not installed", MEGATRON, True),
    (UserWarning, "When using async grad allreduce it is recommended", MEGATRON, True),
    (UserWarning, "full scope is deprecated", MEGATRON, False),
    (DeprecationWarning, "Warning: tp_group is None", MEGATRON, False),
    (
        FutureWarning,
        "`torch.distributed.all_gather_into_tensor` is",
        r"torch\.distributed\.",
        False,
    ),
    (FutureWarning, "Please use DTensor instead and we are deprecating", r"torch\.", False),
    (FutureWarning, "`load_state_dict` is deprecated and will be removed", MEGATRON, False),
)


def _on_cpu(device: Any) -> Any:
    """`device` with CUDA (a "cuda" string, a CUDA torch.device or an ordinal) replaced by CPU."""
    # A bare int means a CUDA ordinal; torch.device(int) itself raises on a CPU-only build.
    if isinstance(device, int) or (device is not None and torch.device(device).type == "cuda"):
        return CPU
    return device


def _factory_on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def build(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return factory(*args, **kwargs)

    return build


class _CpuTorch(types.ModuleType):
    """`torch` as one megatron module sees it: factories asked for device="cuda" build on CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in ("zeros", "ones", "empty", "full", "tensor"):
            setattr(self, name, _factory_on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _current_device() -> torch.device:
    return CPU


class CpuRNGStatesTracker:
    """Megatron's CudaRNGStatesTracker over the CPU generator: named states that `fork()` swaps in.

    Megatron forks the tensor-parallel RNG state around dropout in attention and around weight
    init; the CUDA tracker reads/writes `torch.cuda` generator state, which does not exist here.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(
                f"RNG seed {seed} is already tracked; every tracked state needs its own seed"
            )
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:  # megatron's default
        if name not in self.states_:
            raise KeyError(
                f"RNG state {name!r} is not tracked; call model_parallel_cuda_manual_seed first"
            )
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def _get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(state)


def _synchronize(*args: Any, **kwargs: Any) -> None:
    """torch.cuda.synchronize on CPU: nothing runs asynchronously, so there is nothing to wait
    for."""


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """megatron's clip_grads.clip_grad_by_total_norm_fp32 without its CUDA-only asserts."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _l2_norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: list[list[torch.Tensor]],
    per_tensor: bool,
    *args: Any,
) -> tuple[torch.Tensor, None]:
    """megatron.core.utils.local_multi_tensor_l2_norm, returning the norm on the grads' device."""
    norms = [torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def apply_cpu_shims() -> None:
    """Patch megatron-core for CPU + gloo, once; nothing CUDA-specific when CUDA is present."""
    global _applied
    if _applied:
        return
    from megatron.core.transformer.moe import moe_utils

    # Without Transformer Engine moe_utils never defines `te_general_gemm`, yet the MoE router's
    # gating linear tests `te_general_gemm is not None`: every MoE forward raises NameError.
    # Defining it as None selects megatron's own torch.mm path (a missing-name bug, not a CUDA one).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _local_mla()
    if torch.cuda.is_available():
        _applied = True
        return

    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as transformer_utils

    # Buffers (rotary inv_freq, DDP grad buffers, router/MoE state, rerun state machine, ...) are
    # placed with `device=torch.cuda.current_device()`, which raises on a CPU build. CPU is the
    # only device here, so every such placement means CPU.
    torch.cuda.current_device = _current_device
    # dist_checkpointing's torch_dist writer stages tensors to host memory with non_blocking
    # copies, then waits for them with torch.cuda.synchronize (raises on a CPU build); on CPU
    # those copies are already done.
    torch.cuda.synchronize = _synchronize
    # model_parallel_cuda_manual_seed / get_cuda_rng_tracker build a tracker of CUDA generator
    # states (torch.cuda.get_rng_state raises on CPU); both pick the class through this name.
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    mcore_random.initialize_rng_tracker(force_reset=True)
    # Activation recompute (CheckpointFunction) saves and restores "the CUDA RNG state" around
    # the recomputed forward so dropout masks repeat; on CPU that state is the CPU generator's.
    mcore_random._get_cuda_rng_state = _get_rng_state
    mcore_random._set_cuda_rng_state = _set_rng_state
    # Hard-coded device="cuda" on the CPU path: the default causal mask of every attention call
    # without an explicit mask (transformer.utils); token counts in forward_backward_no_pipelining
    # and the pipelined schedules; the fp32 optimizer's loss scale; grad-norm reductions.
    cpu_torch = _CpuTorch()
    for module in (transformer_utils, schedules, mcore_optimizer, clip_grads):
        module.torch = cpu_torch
    # Grad clipping asserts `param.grad.type() == 'torch.cuda.FloatTensor'`, and the fallback
    # multi-tensor l2 norm (no apex/TE) returns its result on "cuda".
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    clip_grads.l2_norm_impl = _l2_norm
    _applied = True


def _local_mla() -> None:
    """Make multi-latent attention build from megatron's own (non-TE) layer spec, two missing-TE
    bugs: (1) multi_latent_attention sets HAVE_TE when megatron's TE extension module imports,
    which it does without Transformer Engine (TELinear a MagicMock placeholder), then calls
    `isinstance(..., TELinear)`: TypeError; HAVE_TE must say whether TELinear exists. (2) MLA builds
    its core attention with `k_channels`/`v_channels`, which the local DotProductAttention does
    not take: TypeError. Its forward reads the query/key head size from the tensors and sizes its
    output by `config.kv_channels`, so dropping them is exact when kv_channels == v_channels."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False

    init = DotProductAttention.__init__
    if getattr(init, "_accepts_mla_channels", False):
        return

    def patched(
        self: Any,
        config: Any,
        *args: Any,
        k_channels: Any = None,
        v_channels: Any = None,
        **kw: Any,
    ) -> None:
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(
                f"local DotProductAttention sizes its output by kv_channels={config.kv_channels}, "
                f"but MLA's values have {v_channels} channels; set kv_channels=v_head_dim"
            )
        init(self, config, *args, **kw)

    patched._accepts_mla_channels = True  # type: ignore[attr-defined]
    DotProductAttention.__init__ = patched  # type: ignore[method-assign]


def filter_known_warnings() -> None:
    """Ignore KNOWN_WARNINGS; call before megatron is imported, since most of them are issued at
    import. Other warnings, megatron's included, still show."""
    cuda = torch.cuda.is_available()
    for category, message, module, cpu_only in KNOWN_WARNINGS:
        if not (cpu_only and cuda):
            warnings.filterwarnings("ignore", re.escape(message), category, module)


FIRST_PORT = 20000  # above the well-known and most services' registered ports


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago, below the kernel's ephemeral range:
    a port the kernel handed out (bind to 0) can be handed out again to an outgoing socket, such
    as an earlier process group's gloo pairs', before the rendezvous listens on it
    (EADDRINUSE)."""
    low = _ephemeral_low()
    picker = random.Random()  # not the seeded global generator: a port is no part of a result
    for _ in range(64):
        port = picker.randrange(FIRST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use: try another
                continue
            return port
    with socket.socket() as s:  # all tried were taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > FIRST_PORT + 1000 else 32768


def init_model_parallel(
    tp: int = 1,
    pp: int = 1,
    *,
    rank: int = 0,
    world_size: int = 1,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
) -> None:
    """Start torch.distributed (gloo on CPU, nccl on CUDA) if needed, megatron's parallel groups
    and RNG seeds.

    In a single process the defaults are enough; spawned ranks pass rank/world_size and one
    shared port. `ep`: expert-parallel size, carved out of data parallelism (megatron's
    "tp-cp-ep-dp-pp" order: the ep ranks of an expert group are consecutive data-parallel
    ranks); `etp`: expert tensor parallel size, default `tp` (megatron's), at 1 the expert
    groups are carved out of tp x dp instead (trainer_bridge.parallel.expert).
    """
    apply_cpu_shims()
    expert_ranks = (tp if etp is None else etp) * pp * ep
    if world_size % (tp * pp) or world_size % expert_ranks:
        raise ValueError(
            f"world_size={world_size} is not a multiple of tp*pp={tp}*{pp} and of "
            f"etp*pp*ep={expert_ranks}; launch a multiple of both"
        )
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = master_addr
        if master_port is not None:
            os.environ["MASTER_PORT"] = str(master_port)
        elif "MASTER_PORT" not in os.environ:
            if world_size > 1:
                raise ValueError(
                    "several ranks need one shared master_port (or MASTER_PORT in the environment)"
                )
            os.environ["MASTER_PORT"] = str(free_port())
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world_size
        )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    try:
        parallel_state.initialize_model_parallel(
            tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
        )
        model_parallel_cuda_manual_seed(seed)
    except BaseException:
        # Half-initialised global state would make every later initialisation fail.
        destroy_model_parallel()
        raise


def destroy_model_parallel() -> None:
    """Undo `init_model_parallel`: megatron's groups, then the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def model_parallel(tp: int = 1, pp: int = 1, **kwargs: Any) -> Iterator[None]:
    """`init_model_parallel` for the duration of a block (tests, single-process conversion)."""
    init_model_parallel(tp, pp, **kwargs)
    try:
        yield
    finally:
        destroy_model_parallel()
