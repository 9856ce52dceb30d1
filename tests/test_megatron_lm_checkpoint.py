"""A checkpoint written by Megatron-LM's own code reads as --ref-load: tests/data/megatron_lm_qwen2
(scripts/make_megatron_lm_checkpoint.py: Megatron-LM core_v0.16.1's save_checkpoint, torch_dist,
the flow of slime's tools/convert_hf_to_torch_dist.py, on CPU) holds a tiny Qwen2 in Megatron-LM's
--save layout, its args in common.pt, next to the Hugging Face checkpoint of the same weights.
A policy started from another checkpoint of that shape with --ref-load pointed at it holds the
saved weights bit for bit, in the --save layout and in slime's 'release' one, and its log-probs
are transformers' for those weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.filterwarnings("ignore:::megatron"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU megatron tests"),
]
DATA = Path(__file__).parent / "data" / "megatron_lm_qwen2"
SAVE = DATA / "megatron"
ITER = SAVE / "iter_0000001"
TOKENS = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> str:
    """A Hugging Face checkpoint of the saved model's shape with other weights (the policy)."""
    from specrl.tiny_models import build_checkpoint

    path = tmp_path_factory.mktemp("other")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA / "hf" / name, path)
    build = json.loads((DATA / "build.json").read_text())
    build_checkpoint(str(path), **{**build, "seed": build["seed"] + 1})
    return str(path)


def _resolved(model: str, ref_load: str, out: str) -> str:
    from specrl import checkpoint as run_checkpoint
    from specrl.train_options import parse_args

    args = parse_args(
        ["--hf-checkpoint", model, "--prompt-data", "x.jsonl", "--rollout-batch-size", "2"]
        + ["--num-rollout", "1", "--output-dir", out, "--ref-load", ref_load, "--use-kl-loss"]
    )
    run_checkpoint.resolve(args, json.loads(Path(model, "config.json").read_text()))
    return args.options.trainer.ref_load


def _policy(model: str, ref_load: str | None = None):
    """(state dict, reference log-probs, policy log-probs) of a TrainActor."""
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.loss import LossConfig
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    actor = TrainActor(
        TrainerArgs(hf_checkpoint=model, ref_load=ref_load),
        LossConfig(use_kl_loss=True, kl_loss_coef=0.1),
    )
    try:
        batch = TrainBatch(TOKENS, [4, 4], [1.0, 0.0], n_samples_per_prompt=2)
        state = {
            k: v.detach().clone()
            for k, v in actor.gpt.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
        return state, actor.compute_log_probs(batch, reference=True), actor.compute_log_probs(batch)
    finally:
        destroy_model_parallel()


def test_the_checkpoint_is_megatron_lms_and_fits_the_model():
    import megatron.core  # noqa: F401  (registers the enums Megatron-LM's args hold)

    from trainer_bridge.checkpoint import check_megatron_model, read_common

    common = torch.load(ITER / "common.pt", map_location="cpu", weights_only=True)
    assert common["args"].ckpt_format == "torch_dist" and common["iteration"] == 1
    assert len(vars(common["args"])) > 500  # Megatron-LM's whole Namespace, not an imitation
    assert read_common(str(ITER), megatron_lm=True) is None  # no specrl entry: Megatron-LM's
    hf_config = json.loads((DATA / "hf" / "config.json").read_text())
    check_megatron_model(str(ITER), hf_config)
    with pytest.raises(ValueError, match="hidden size 64 vs 128"):
        check_megatron_model(str(ITER), {**hf_config, "hidden_size": 128})


def test_ref_load_of_megatron_lms_save_holds_its_weights(other, tmp_path):
    want_state, want, _ = _policy(str(DATA / "hf"))
    _, other_logps, _ = _policy(other)
    assert other_logps != want
    release = tmp_path / "release_root"
    shutil.copytree(ITER, release / "release")
    (release / "latest_checkpointed_iteration.txt").write_text("release")
    for root, expected in ((SAVE, ITER), (release, release / "release")):
        ref_load = _resolved(other, str(root), str(tmp_path / "out"))
        assert ref_load == str(expected)
        state, reference, policy = _policy(other, ref_load)
        assert state.keys() == want_state.keys()
        assert [k for k in state if not torch.equal(state[k], want_state[k])] == []
        assert reference == want and policy == want


def test_its_log_probs_are_transformers(other):
    from transformers import AutoModelForCausalLM

    _, logps, _ = _policy(other, str(ITER))
    model = AutoModelForCausalLM.from_pretrained(DATA / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        for tokens, got in zip(TOKENS, logps):
            logits = model(torch.tensor([tokens], device="cpu")).logits[0]
            rows, targets = torch.arange(3, 7, device="cpu"), torch.tensor(tokens[4:], device="cpu")
            want = torch.log_softmax(logits, -1)[rows, targets]
            assert (torch.tensor(got, device="cpu") - want).abs().max().item() < 1e-4
