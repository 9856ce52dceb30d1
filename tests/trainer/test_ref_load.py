"""--ref-load (slime's flag): the weights a run starts from and its KL reference model, from a
--save directory (the policy of its latest checkpoint), slime's torch_dist, a converted megatron
checkpoint or a Hugging Face checkpoint; resolved and checked before anything starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from specrl import checkpoint as run_checkpoint
from specrl.train_options import parse_args

pytest.importorskip("megatron.core")

TOKENS = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module")
def models(make_model) -> tuple[str, str, str]:
    """(the policy's checkpoint, another of the same shape, one of another shape)."""
    return (
        make_model("qwen2", num_layers=2, seed=61),
        make_model("qwen2", num_layers=2, seed=62),
        make_model("qwen2", num_layers=2, seed=61, intermediate_size=48),
    )


def resolved(model: str, ref_load: str, out: str, *flags: str) -> str:
    args = parse_args(
        ["--hf-checkpoint", model, "--prompt-data", "x.jsonl", "--rollout-batch-size", "2"]
        + ["--num-rollout", "1", "--output-dir", out, "--ref-load", ref_load, *flags]
    )
    with open(f"{model}/config.json") as f:
        run_checkpoint.resolve(args, json.load(f))
    return args.options.trainer.ref_load


def actor(model: str, ref_load: str | None = None, lr: float = 1e-2):
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.loss import LossConfig
    from trainer_bridge.options import TrainerArgs

    return TrainActor(
        TrainerArgs(hf_checkpoint=model, lr=lr, ref_load=ref_load),
        LossConfig(use_kl_loss=True, kl_loss_coef=0.1),
        temperature=1.0,
    )


def batch():
    from trainer_bridge.batch import TrainBatch

    return TrainBatch(TOKENS, [4, 4], [1.0, 0.0], n_samples_per_prompt=2)


def test_ref_load_reads_a_save_directory_or_a_hugging_face_checkpoint(models, tmp_path, hf):
    from trainer_bridge.megatron_compat import destroy_model_parallel

    policy, other, _ = models
    save, out = str(tmp_path / "save"), str(tmp_path / "out")
    trained = actor(policy)
    trained.train(batch())  # the saved policy differs from --hf-checkpoint's weights
    run_checkpoint.save(save, 3, lambda d: trained.save_checkpoint(d, 3), {"weight_version": 1})
    saved_logps = trained.compute_log_probs(batch())
    destroy_model_parallel()

    assert resolved(policy, save, out, "--use-kl-loss") == run_checkpoint.iter_dir(save, 3)
    a = actor(policy, run_checkpoint.iter_dir(save, 3))
    assert a.compute_log_probs(batch(), reference=True) == saved_logps
    # slime's start: the policy begins where the reference is, not at --hf-checkpoint's weights
    assert a.compute_log_probs(batch()) == saved_logps
    a.train(batch())  # and trains away from it while the reference stays
    assert a.compute_log_probs(batch()) != saved_logps
    assert a.compute_log_probs(batch(), reference=True) == saved_logps
    destroy_model_parallel()

    assert resolved(policy, other, out, "--use-kl-loss") == other
    b = actor(policy, other)
    got = b.compute_log_probs(batch(), reference=True)
    destroy_model_parallel()
    for tokens, logps in zip(TOKENS, got):
        logits = hf.model(other)(torch.tensor([tokens])).logits[0].float()
        want = torch.log_softmax(logits, -1)[torch.arange(3, 7), torch.tensor(tokens[4:])]
        assert torch.allclose(torch.tensor(logps), want, atol=1e-4), (logps, want)


def test_a_bad_ref_load_is_refused_naming_it(models, tmp_path):
    policy, _, other_shape = models
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit, match="is not a directory"):
        resolved(policy, str(tmp_path / "missing"), out, "--use-kl-loss")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="neither a --save directory"):
        resolved(policy, str(tmp_path / "empty"), out, "--use-kl-loss")
    with pytest.raises(SystemExit, match=r"holds another model than --hf-checkpoint \(interm"):
        resolved(policy, other_shape, out, "--use-kl-loss")


def test_ref_load_reads_the_converters_megatron_checkpoint_at_another_tp_size(models, tmp_path):
    """slime's flow: `--ref-load` of the model converted to megatron's layout beforehand. Here
    `trainer_bridge.convert hf-to-mcore --tp 2` output, loaded by a TP 1 trainer: the reference
    log-probs equal those of the Hugging Face checkpoint it came from, bit for bit."""
    from trainer_bridge.convert import hf_to_mcore
    from trainer_bridge.megatron_compat import destroy_model_parallel

    policy, other, other_shape = models
    out = str(tmp_path / "out")
    converted, wrong = str(tmp_path / "mcore"), str(tmp_path / "mcore-other-shape")
    hf_to_mcore(other, converted, tp=2)
    hf_to_mcore(other_shape, wrong, tp=2)

    assert resolved(policy, converted, out, "--use-kl-loss") == converted
    with pytest.raises(SystemExit, match=r"holds another model than --hf-checkpoint \(interm"):
        resolved(policy, wrong, out, "--use-kl-loss")
    from_mcore = actor(policy, converted).compute_log_probs(batch(), reference=True)
    destroy_model_parallel()
    from_hf = actor(policy, other).compute_log_probs(batch(), reference=True)
    destroy_model_parallel()
    assert from_mcore == from_hf


def megatron_lm_release(model: str, root: str) -> None:
    """What slime's tools/convert_hf_to_torch_dist.py leaves in `root`: Megatron-LM's save of
    the model alone in root/release (bfloat16 weights, the vocabulary padded for TP 2, Megatron's
    args and enums in common.pt) and 'release' in the latest file."""
    import argparse
    import dataclasses

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.enums import ModelType

    from trainer_bridge.megatron_compat import destroy_model_parallel

    sharded = actor(model).gpt.sharded_state_dict()
    for key, t in sharded.items():
        if isinstance(t, ShardedTensorFactory):  # e.g. a gated MLP's fc1, saved as two halves
            sharded[key] = dataclasses.replace(t, data=t.data.to(torch.bfloat16))
        if not isinstance(t, ShardedTensor):
            continue
        data = t.data.to(torch.bfloat16)
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            data = torch.cat([data, data.new_zeros(128, data.shape[1])])  # 128 more rows at TP 2
        shape = dict(local_shape=tuple(data.shape), global_shape=tuple(data.shape))
        sharded[key] = dataclasses.replace(
            t, data=data, dtype=torch.bfloat16, **(shape if t.prepend_axis_num == 0 else {})
        )
    args = argparse.Namespace(
        bf16=True, model_type=ModelType.encoder_or_decoder, ckpt_format="torch_dist"
    )
    os.makedirs(os.path.join(root, "release"))
    dist_checkpointing.save(
        {"model": sharded, "args": args, "checkpoint_version": 3.0, "iteration": 1},
        os.path.join(root, "release"),
    )
    destroy_model_parallel()
    with open(os.path.join(root, run_checkpoint.LATEST_FILE), "w") as f:
        f.write("release")


def test_ref_load_reads_slimes_torch_dist_checkpoint(models, tmp_path):
    """slime's own flow: --ref-load of its tools/convert_hf_to_torch_dist.py output (Megatron-LM's
    layout, bfloat16, padded for another TP size). The reference log-probs equal those of the
    Hugging Face checkpoint it came from with its weights rounded to bfloat16, bit for bit; one of
    another shape is refused before anything starts, naming what differs."""
    from safetensors.torch import load_file, save_file

    from trainer_bridge.megatron_compat import destroy_model_parallel

    policy, other, other_shape = models
    out = str(tmp_path / "out")
    release, wrong = str(tmp_path / "torch_dist"), str(tmp_path / "torch_dist_other_shape")
    megatron_lm_release(other, release)
    megatron_lm_release(other_shape, wrong)
    rounded = str(tmp_path / "rounded")
    shutil.copytree(other, rounded)
    weights = os.path.join(rounded, "model.safetensors")
    save_file(
        {k: v.to(torch.bfloat16).float() for k, v in load_file(weights).items()},
        weights,
        metadata={"format": "pt"},
    )

    assert resolved(policy, release, out, "--use-kl-loss") == os.path.join(release, "release")
    # The launcher reads Megatron-LM's common.pt (its args, its enums) before megatron is imported.
    code = (
        "import sys; from trainer_bridge.checkpoint import read_common as f; "
        "assert 'megatron.core' not in sys.modules; "
        f"print(f({os.path.join(release, 'release')!r}, megatron_lm=True))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "None", proc.stderr[-2000:]
    with pytest.raises(SystemExit, match=r"another model than --hf-checkpoint \(intermediate size"):
        resolved(policy, wrong, out, "--use-kl-loss")
    from_slime = actor(policy, os.path.join(release, "release"))
    got = from_slime.compute_log_probs(batch(), reference=True)
    destroy_model_parallel()
    want = actor(policy, rounded).compute_log_probs(batch(), reference=True)
    destroy_model_parallel()
    assert got == want
    # Megatron-LM's checkpoint is not one --load resumes
    with pytest.raises(SystemExit, match="holds 'release', not a rollout id"):
        resolved(policy, release, out, "--use-kl-loss", "--load", release)


def test_a_torch_dist_checkpoint_without_mtp_layers_keeps_the_hf_checkpoints(
    make_model, tmp_path, monkeypatch
):
    """slime's converter run without --mtp-num-layers: a MiMo policy started from (and
    referenced to) it takes the trunk from the checkpoint, bit for bit as the plain model reads
    it, and keeps --hf-checkpoint's MTP layer, saying so."""
    from tiny.checkpoints import add_mimo_mtp
    from trainer_bridge.checkpoint import load as load_module
    from trainer_bridge.megatron_compat import destroy_model_parallel

    # A seed of its own: other tests add MTP layers to their cached models in place.
    base = make_model("qwen2", num_layers=2, seed=77)
    mimo = str(tmp_path / "mimo")
    shutil.copytree(base, mimo)
    add_mimo_mtp(mimo, seed=78)
    release = str(tmp_path / "torch_dist")
    megatron_lm_release(base, release)
    directory = os.path.join(release, "release")
    assert resolved(mimo, release, str(tmp_path / "out")) == directory

    plain = actor(base, directory)
    want = plain.compute_log_probs(batch())
    destroy_model_parallel()
    fresh = actor(mimo)
    hf_mtp = {
        k: v.clone()
        for k, v in fresh.gpt.state_dict().items()
        if k.startswith("mtp.") and isinstance(v, torch.Tensor)
    }
    destroy_model_parallel()
    # The warning as the module issues it (a library's logging set-up earlier in the suite can
    # keep records from pytest's capture).
    warned = []
    monkeypatch.setattr(load_module.logger, "warning", lambda *a: warned.append(a[0] % a[1:]))
    started = actor(mimo, directory)
    try:
        assert len(warned) == 1 and "holds no MTP layers" in warned[0], warned
        assert started.compute_log_probs(batch()) == want
        assert started.compute_log_probs(batch(), reference=True) == want
        mtp = {
            k: v
            for k, v in started.gpt.state_dict().items()
            if k.startswith("mtp.") and isinstance(v, torch.Tensor)
        }
        assert hf_mtp and mtp.keys() == hf_mtp.keys()
        assert all(torch.equal(v, hf_mtp[k]) for k, v in mtp.items())
    finally:  # the next test initializes its own model parallel state
        destroy_model_parallel()
