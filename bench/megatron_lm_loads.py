"""Megatron-LM's own `load_checkpoint` (megatron/training/checkpointing.py, core_v0.16.1) reading a
checkpoint specrl's trainer saved, as slime's `--load` would: does slime resume from specrl?

A tiny model (--arch: a dense Qwen2, a DeepSeek-V3 with MLA, MoE and one MTP layer, or a GLM-4.5
with GQA, MoE and one MTP layer: tiny/megatron_lm.py's builds) takes one
training step in specrl's TrainActor, which saves its checkpoint under OUT/specrl/iter_0000001
with latest_checkpointed_iteration.txt, the layout specrl's --save writes. Megatron-LM then parses
the flags a slime run of this model passes plus `--load OUT/specrl` and each FLAGS set given,
builds its own model (model_provider(gpt_builder)) and calls load_checkpoint([model], None, None)
(the model only: no optimizer is built; whether its optimizers could read specrl's Adam state is
answered in docs/checkpoints.md: no); every weight must equal the saving actor's, bit for bit.

The model is the one slime's runs build with Transformer Engine, as far as a checkpoint sees it.
There is no TE here, so Megatron-LM builds its local spec (--transformer-impl local), whose
checkpoint names differ from TE's for MLA and MoE norms (megatron-core maps them onto TE's for
dense GQA layers only) and which lacks the `_extra_state` entries TE's modules ask for. The
script gives Megatron-LM's layer and MTP specs TE's names and its modules TE's extra states with
trainer_bridge.model.checkpoint_names, the same rules specrl's model uses, which
tests/trainer/test_checkpoint_names.py checks against megatron-core's own TE specs.

    python -m scripts.megatron_lm_loads_specrl --megatron-lm /tmp/Megatron-LM --out /tmp/lm-load \
        --arch deepseek_v3 --flags "" --flags "--no-load-rng" --flags "--finetune"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from tiny.megatron_lm import (
    BUILDS,
    _stub_triton,
    build_hf,
    megatron_lm_args,
    megatron_lm_model,
)
from trainer_bridge.megatron_compat import apply_cpu_shims, filter_known_warnings


def save_specrl(hf_dir: str, root: str) -> dict[str, torch.Tensor]:
    """One training step of specrl's actor, saved as its --save does; returns its weights."""
    from specrl.checkpoint import new_run_state, new_wandb_run_id, save
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.loss import LossConfig
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    actor = TrainActor(TrainerArgs(hf_checkpoint=hf_dir, lr=1e-2), LossConfig())
    try:
        tokens = [list(range(5, 17)), list(range(20, 32))]
        actor.train(TrainBatch(tokens, [6, 6], [1.0, 0.0], n_samples_per_prompt=2))
        # specrl's own --save: iter_0000001/ with rollout_state.json, then the tracker file
        state = new_run_state(1, {}, new_wandb_run_id())
        save(root, 1, lambda directory: actor.save_checkpoint(directory, 1), state)
        state = actor.gpt.state_dict()
        return {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    finally:
        destroy_model_parallel()


def megatron_lm_load(root: str, hf_config: dict, flags: list[str], scratch: str) -> dict:
    """Megatron-LM's model after its load_checkpoint of `root` under `flags`."""
    from megatron.training import checkpointing
    from megatron.training.global_vars import set_args

    from trainer_bridge.megatron_compat import destroy_model_parallel, init_model_parallel

    args = megatron_lm_args(scratch, hf_config, ("--load", root, *flags))
    set_args(args)
    init_model_parallel(1, 1, seed=args.seed)
    # CPU shim, as make_megatron_lm_checkpoint's: the CPU generator's state for the CUDA one
    cuda_get_rng_state, read_metadata = torch.cuda.get_rng_state, checkpointing.read_metadata
    if not torch.cuda.is_available():
        torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
        # read_metadata all-reduces the tracker's iteration over the ranks in a device="cuda"
        # tensor; one rank here: its own reading is the maximum
        checkpointing.read_metadata = _read_tracker
    try:
        with te_named_models():
            model = megatron_lm_model(args)
        iteration, _ = checkpointing.load_checkpoint([model], None, None)
        print(f"  load_checkpoint returned iteration {iteration}")
        return model.state_dict()
    finally:
        torch.cuda.get_rng_state, checkpointing.read_metadata = cuda_get_rng_state, read_metadata
        destroy_model_parallel()


@contextlib.contextmanager
def te_named_models() -> Iterator[None]:
    """Within: Megatron-LM's gpt_builder builds GPTModels whose layers save and load under
    Transformer Engine's checkpoint names, with TE's extra states and its replicated MLA key/value
    down projection (trainer_bridge.model.checkpoint_names,
    trainer_bridge.parallel.sequence.replicated_kv_down_proj)."""
    import gpt_builders

    from trainer_bridge.model.checkpoint_names import te_checkpoint_names, te_extra_states
    from trainer_bridge.parallel.sequence import replicated_kv_down_proj

    gpt_model = gpt_builders.GPTModel

    def te_spec(spec: Any) -> Any:
        return None if spec is None else te_checkpoint_names(replicated_kv_down_proj(spec))

    def build(*, transformer_layer_spec: Any, mtp_block_spec: Any = None, **kwargs: Any) -> Any:
        model = gpt_model(
            transformer_layer_spec=te_spec(transformer_layer_spec),
            mtp_block_spec=te_spec(mtp_block_spec),
            **kwargs,
        )
        te_extra_states(model)
        return model

    gpt_builders.GPTModel = build
    try:
        yield
    finally:
        gpt_builders.GPTModel = gpt_model


def _read_tracker(tracker_filename: str) -> tuple[int, bool]:
    """Megatron-LM's read_metadata on one rank: (iteration, release) from the tracker file."""
    with open(tracker_filename) as f:
        text = f.read().strip()
    return (0, True) if text == "release" else (int(text), False)


def load_flag_sets(out: str, flag_sets: list[str], arch: str = "qwen2") -> int:
    """Each flag set's outcome printed; returns how many loaded every weight exactly."""
    hf_dir, root = os.path.join(out, "hf"), os.path.join(out, "specrl")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(hf_dir)
    build_hf(hf_dir, BUILDS[arch])
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    apply_cpu_shims()
    want = save_specrl(hf_dir, root)
    _stub_triton()  # then import megatron.training
    exact = 0
    for i, flags in enumerate(flag_sets):
        print(f"Megatron-LM --load {root} {flags}".rstrip())
        try:
            got = megatron_lm_load(root, hf_config, shlex.split(flags), f"{out}/save{i}")
        # the answer for this flag set, reported before the next one runs (Megatron-LM calls
        # sys.exit on some load errors)
        except (Exception, SystemExit) as error:
            print(f"  FAILED: {type(error).__name__}: {str(error)[:600]}")
            traceback.print_exc()
            continue
        got = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        differ = [k for k in set(want) & set(got) if not torch.equal(got[k], want[k])]
        print(
            f"  {len(want)} weights: {len(differ)} differ {differ[:3]}, missing {missing[:3]}, "
            f"Megatron-LM's own {extra[:3]}"
        )
        exact += not (differ or missing or extra)
    return exact


def main(argv: list[str] | None = None) -> None:
    """`python -m scripts.megatron_lm_loads_specrl`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout")
    parser.add_argument("--arch", choices=sorted(BUILDS), default="qwen2")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--flags", action="append", default=None, help="one set of extra Megatron-LM flags"
    )
    cli = parser.parse_args(argv)
    sys.path.append(os.path.abspath(cli.megatron_lm))
    filter_known_warnings()
    sets = cli.flags if cli.flags is not None else [""]
    loaded = load_flag_sets(os.path.abspath(cli.out), sets, cli.arch)
    print(f"{loaded} of {len(sets)} flag sets loaded every weight exactly")
    sys.exit(0 if loaded else 1)
