"""Checkpoints written by Megatron-LM's own code read as --ref-load: tests/data/megatron_lm_<arch>
(scripts/make_megatron_lm_checkpoint.py, code in tiny/megatron_lm.py: Megatron-LM core_v0.16.1's
save_checkpoint, torch_dist, the flow of slime's tools/convert_hf_to_torch_dist.py, on CPU) hold
a tiny Qwen2, a tiny DeepSeek-V3 (MLA, a dense layer then MoE, one MTP layer) and a tiny GLM-4.5
(GQA with q/k norms, partial rotary, the same MoE and MTP) in Megatron-LM's --save layout, its args
in common.pt, next to the Hugging Face checkpoint of the same weights. Megatron-LM built them
with its local layer spec, whose MLA and MoE layers name their norms otherwise than the TE-named
ones this trainer saves (trainer_bridge.model.checkpoint_names). A policy started from another
checkpoint of that shape with --ref-load pointed at one holds the saved weights bit for bit (its
MTP layer's too), in the --save layout and in slime's 'release' one, and its log-probs are
transformers' for those weights."""

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
ARCHS = ("qwen2", "deepseek_v3", "glm4_moe")
TOKENS = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]]


def _data(arch: str) -> tuple[Path, Path, Path]:
    """(the fixture's directory, Megatron-LM's --save directory, its iteration's directory)"""
    data = Path(__file__).parents[1] / "data" / f"megatron_lm_{arch}"
    return data, data / "megatron", data / "megatron" / "iter_0000001"


@pytest.fixture(scope="module", params=ARCHS)
def saved(request, tmp_path_factory) -> tuple[str, str]:
    """(the saved model's architecture, a Hugging Face checkpoint of its shape with other
    weights: the policy)"""
    from tiny.checkpoints import build_checkpoint

    data, _, _ = _data(request.param)
    path = tmp_path_factory.mktemp("other")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data / "hf" / name, path)
    build = json.loads((data / "build.json").read_text())
    build_checkpoint(str(path), **{**build, "seed": build["seed"] + 1})
    return request.param, str(path)


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


@pytest.mark.parametrize("arch", ARCHS)
def test_the_checkpoint_is_megatron_lms_and_fits_the_model(arch):
    import megatron.core  # noqa: F401  (registers the enums Megatron-LM's args hold)

    from trainer_bridge.checkpoint import check_megatron_model, read_common

    data, _, iteration = _data(arch)
    common = torch.load(iteration / "common.pt", map_location="cpu", weights_only=True)
    assert common["args"].ckpt_format == "torch_dist" and common["iteration"] == 1
    assert len(vars(common["args"])) > 500  # Megatron-LM's whole Namespace, not an imitation
    assert read_common(str(iteration), megatron_lm=True) is None  # no specrl entry: Megatron-LM's
    hf_config = json.loads((data / "hf" / "config.json").read_text())
    check_megatron_model(str(iteration), hf_config)
    others = [
        ({"hidden_size": 128}, "hidden size 64 vs 128"),
        ({"num_hidden_layers": 3}, "layers 2 vs 3"),
    ]
    if arch != "qwen2":  # a dense layer then MoE: each layer under its own number
        assert common["args"].mtp_num_layers == 1
        assert common["args"].multi_latent_attention == (arch == "deepseek_v3")
        others += [
            ({"n_routed_experts": 16}, "routed experts 8 vs 16"),
            ({"intermediate_size": 32}, "intermediate size 64 vs 32"),
        ]
    for change, message in others:
        with pytest.raises(ValueError, match=message):
            check_megatron_model(str(iteration), {**hf_config, **change})


def test_ref_load_of_megatron_lms_save_holds_its_weights(saved, tmp_path):
    arch, other = saved
    data, save, iteration = _data(arch)
    want_state, want, _ = _policy(str(data / "hf"))
    _, other_logps, _ = _policy(other)
    assert other_logps != want
    if arch != "qwen2":
        assert any(k.startswith("mtp.") for k in want_state)
    release = tmp_path / "release_root"
    shutil.copytree(iteration, release / "release")
    (release / "latest_checkpointed_iteration.txt").write_text("release")
    for root, expected in ((save, iteration), (release, release / "release")):
        ref_load = _resolved(other, str(root), str(tmp_path / "out"))
        assert ref_load == str(expected)
        state, reference, policy = _policy(other, ref_load)
        assert state.keys() == want_state.keys()
        assert [k for k in state if not torch.equal(state[k], want_state[k])] == []
        assert reference == want and policy == want


def test_its_log_probs_are_transformers(saved):
    from transformers import AutoModelForCausalLM

    arch, other = saved
    data, _, iteration = _data(arch)
    _, logps, _ = _policy(other, str(iteration))
    model = AutoModelForCausalLM.from_pretrained(data / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        for tokens, got in zip(TOKENS, logps):
            logits = model(torch.tensor([tokens], device="cpu")).logits[0]
            rows, targets = torch.arange(3, 7, device="cpu"), torch.tensor(tokens[4:], device="cpu")
            want = torch.log_softmax(logits, -1)[rows, targets]
            assert (torch.tensor(got, device="cpu") - want).abs().max().item() < 1e-4


def test_load_of_megatron_lms_save_is_refused_naming_ref_load(tmp_path):
    """--load resumes specrl's own checkpoints; slime's --save (Megatron-LM's) is refused before
    anything starts, naming --ref-load, which starts from its weights."""
    from specrl import checkpoint as run_checkpoint
    from specrl.train_options import parse_args

    data, save, _ = _data("deepseek_v3")
    model = str(data / "hf")
    args = parse_args(
        ["--hf-checkpoint", model, "--prompt-data", "x.jsonl", "--rollout-batch-size", "2"]
        + ["--num-rollout", "1", "--output-dir", str(tmp_path), "--load", str(save)]
    )
    with pytest.raises(SystemExit, match=f"holds a Megatron-LM checkpoint.*--ref-load {save}"):
        run_checkpoint.resolve(args, json.loads(Path(model, "config.json").read_text()))
