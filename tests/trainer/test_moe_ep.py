"""MoE models train at expert parallelism 2 (two spawned gloo ranks: TP 1, DP 2, each rank holding
4 of the 8 routed experts, megatron's allgather token dispatcher): for tiny GLM-4.5 (grouped
routing, replayed random routes, a next-n layer trained online, padded rows of different widths
on the two ranks) and DeepSeek-V3 (MLA, packed, megatron's balance loss and the expert-bias
update), the TrainActor's log-probs of a batch equal one process's, and one optimizer step over
the same global batch gives that process's metrics (grad norm, losses), log-probs and updated
weights (every expert exported once, under its global number, by hf_named_tensors and
--save-hf). A checkpoint of each rank's experts resumes bit for bit at EP 2, and at the other
EP size (EP 2 -> one process, one process -> EP 2) takes the next step the saving run took, Adam's
state following each expert. Conversion keeps each rank's own experts and gathers them back
bit-exactly; world sizes, expert counts, expert tensor parallel sizes and an older specrl's EP 2
checkpoints, which do not fit, are refused.

Broken on purpose, each of these fails here: experts exported without the broadcast from their
rank (the round trip), expert gradients averaged over the whole data-parallel group (grad norm),
experts loaded and exported under a consistently wrong global number (log-probs), micro batches
not padded to the expert group's length (gloo aborts the all-gather), the balance loss's
gradient not scaled to its micro batches' mean (log-probs after the step), dynamic micro batches
not made as many on both ranks (the ranks hang in mismatched collectives); at the other EP size,
Adam's state restored onto the neighbouring expert (log-probs after the resumed step 0.044 off,
weights 1.7 LR), Adam's step count lost (0.67, 0.35 LR), its moments lost (0.47, 1.4 LR)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from conftest import FAMILIES
from test_moe_tp import _max_diff, _ports

from tests.support.forkserver import start_ranks
from trainer_bridge.convert.__main__ import main as convert_cli

pytestmark = [
    pytest.mark.filterwarnings("ignore:::megatron"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU megatron tests"),
]
VOCAB = 300
LR = 1e-3
RATE = 1e-2  # --moe-router-bias-update-rate of the DeepSeek-V3 run
# name -> (checkpoint kwargs, trainer options, sequence lengths: two per data-parallel rank)
RUNS = {
    "glm4_moe": (
        FAMILIES["glm4_moe"],
        dict(qkv_format="bshd", enable_mtp_training=True, use_rollout_routing_replay=True),
        (11, 9, 7, 10),  # rank 1's rows (width 10) are padded to rank 0's width 11
    ),
    "deepseek_v3": (
        dict(arch="deepseek_v3"),
        dict(qkv_format="thd", moe_aux_loss_coeff=1e-2, moe_router_bias_update_rate=RATE),
        # equal packs: the balance loss, computed per pack, sees no padding on either rank
        (12, 8, 10, 10),
    ),
    # slime's --balance-data and dynamic batch size: rank 0 trains rows 0 and 2 (11 + 7 tokens),
    # rank 1 rows 1 and 3 (9 + 10), in packs of at most 18 tokens. Rank 0's fit in one, which it
    # splits to run two as rank 1 does (the expert all-gathers pair up); one process runs
    # [11, 7], [9], [10].
    "glm4_moe_dynamic": (
        FAMILIES["glm4_moe"],
        dict(
            qkv_format="thd",
            use_rollout_routing_replay=True,
            balance_data=True,
            use_dynamic_batch_size=True,
            max_tokens_per_gpu=18,
        ),
        (11, 9, 7, 10),
    ),
}


@pytest.fixture(scope="module")
def checkpoints(make_model) -> dict[str, str]:
    return {name: make_model(**kw, vocab_size=VOCAB) for name, (kw, _, _) in RUNS.items()}


def _batch(lengths: tuple[int, ...], path: str):
    """Sequences of `lengths` (two prompts of two samples), with random routed experts (distinct
    per token) as the engine would report them."""
    from spec_engine.models.hf_config import ModelConfig
    from trainer_bridge.batch import TrainBatch

    arch = ModelConfig.load(path)
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(5, VOCAB, (n,), generator=g, device="cpu").tolist() for n in lengths]
    routes = [
        torch.stack(
            [
                torch.randperm(arch.moe.num_experts, generator=g)[: arch.moe.top_k]
                for _ in range((n - 1) * arch.num_hidden_layers)
            ]
        )
        .view(n - 1, arch.num_hidden_layers, arch.moe.top_k)
        .int()
        for n in lengths
    ]
    return TrainBatch(
        tokens,
        [4, 3, 5, 2],
        [1.0, 0.0, 0.0, 1.0],
        n_samples_per_prompt=2,
        rollout_routed_experts=routes,
    )


def _run(rank: int, world_size: int, ports: list[int], jobs: dict, out_dir: str) -> None:
    """Each model on this rank of `world_size` (EP = world size): log-probs of the whole batch,
    one RL step, log-probs again and the exported weights; rank 0 saves them. DeepSeek-V3 goes on
    to `_checkpoint_steps`."""
    torch.set_num_threads(1)
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.convert import load_mcore_rank, read_hf_weights
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    for i, (name, (path, options, lengths)) in enumerate(jobs.items()):
        args = TrainerArgs(
            hf_checkpoint=path,
            lr=LR,
            micro_batch_size=2,
            expert_model_parallel_size=world_size,
            **options,
        )
        actor = TrainActor(args, rank=rank, world_size=world_size, master_port=ports[i])
        try:
            experts = actor.gpt.decoder.layers[-1].mlp.experts.local_experts
            assert len(experts) == 8 // world_size
            loaded = {k: v.clone() for k, v in actor.hf_named_tensors()}  # collective
            initial = read_hf_weights(path)
            assert loaded.keys() == initial.keys()  # HF -> this rank's experts -> HF: bit-exact
            assert [k for k in initial if not torch.equal(loaded[k], initial[k])] == []
            if world_size > 1 and name == "glm4_moe":  # the converter's --ep 2 file of this rank
                converted = load_mcore_rank(os.path.join(out_dir, "mcore-ep2"), 0, rank)
                state = actor.gpt.state_dict()
                assert converted.keys() == {k for k in state if not k.endswith("_extra_state")}
                assert [k for k in converted if not torch.equal(converted[k], state[k])] == []
            batch = _batch(lengths, path)
            _step_and_export(actor, name, batch, out_dir, f"ep{world_size}")
            if name == "deepseek_v3":
                _checkpoint_steps(actor, batch, out_dir, world_size)
        finally:
            destroy_model_parallel()


def _check_loaded(actor, path: str, mcore: str) -> None:
    """This rank's tensors equal the converter's file for its TP and expert-parallel rank, and
    the export (a collective) equals the Hugging Face checkpoint."""
    from megatron.core import parallel_state

    from trainer_bridge.convert import load_mcore_rank, read_hf_weights

    converted = load_mcore_rank(
        mcore,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_expert_model_parallel_rank(),
    )
    state = actor.gpt.state_dict()
    assert converted.keys() == {k for k in state if not k.endswith("_extra_state")}
    assert [k for k in converted if not torch.equal(converted[k], state[k])] == []
    loaded = {k: v.clone() for k, v in actor.hf_named_tensors()}
    initial = read_hf_weights(path)
    assert loaded.keys() == initial.keys()
    assert [k for k in initial if not torch.equal(loaded[k], initial[k])] == []


def _step_and_export(actor, name: str, batch, out_dir: str, tag: str) -> None:
    """One RL step on `actor`: log-probs before and after, metrics and exported weights, saved by
    rank 0 as `{name}-{tag}.pt`; GLM-4.5 on several ranks also checks `--save-hf` (rank 0 writes
    it with the other ranks' experts) against the export."""
    from trainer_bridge.convert import read_hf_weights

    before = actor.compute_log_probs(batch)
    metrics = {k: v for k, v in actor.train(batch).items() if not k.startswith("perf/")}
    after = actor.compute_log_probs(batch)
    weights = {k: v.clone() for k, v in actor.hf_named_tensors()}
    if actor.world_size > 1 and name == "glm4_moe":
        actor.save_hf(os.path.join(out_dir, f"{name}-hf"))
        if actor.rank == 0:
            saved = read_hf_weights(os.path.join(out_dir, f"{name}-hf"))
            assert saved.keys() == weights.keys()
            assert [k for k in saved if not torch.equal(saved[k], weights[k])] == []
    if actor.rank == 0:
        torch.save((before, metrics, after, weights), os.path.join(out_dir, f"{name}-{tag}.pt"))


def _next_step(actor, batch) -> tuple[dict, list, dict]:
    """One more RL step: its metrics, then the log-probs and (every expert's) weights after it."""
    metrics = {k: v for k, v in actor.train(batch).items() if not k.startswith("perf/")}
    after = actor.compute_log_probs(batch)
    return metrics, after, {k: v.clone() for k, v in actor.hf_named_tensors()}


def _assert_same_step(a: tuple, b: tuple) -> None:
    """Two `_next_step` results are equal bit for bit."""
    assert a[0] == b[0] and a[1] == b[1]
    assert [k for k in a[2] if not torch.equal(a[2][k], b[2][k])] == []


def _checkpoint_steps(actor, batch, out_dir: str, world_size: int) -> None:
    """Each rank saves its experts (and the rest) with the optimizer and RNG after the first step,
    then takes a second step. At EP 2, a step from the loaded checkpoint repeats it bit for bit;
    one from the EP 1 checkpoint is saved beside it (rank 0) for the test to compare."""
    directory = os.path.join(out_dir, f"ckpt-ep{world_size}")
    os.makedirs(directory, exist_ok=True)
    actor.save_checkpoint(directory, 0)
    steps = [_next_step(actor, batch)]
    if world_size > 1:
        assert actor.load_checkpoint(directory) == 0
        _assert_same_step(_next_step(actor, batch), steps[0])
        assert actor.load_checkpoint(os.path.join(out_dir, "ckpt-ep1")) == 0
        steps.append(_next_step(actor, batch))
    if actor.rank == 0:
        torch.save(steps, os.path.join(out_dir, f"next-ep{world_size}.pt"))


def _resume_at_ep1(job: tuple, port: int, out_dir: str) -> None:
    """A fresh single process (EP 1) loads the EP 2 checkpoint and takes the next step."""
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    path, options, lengths = job
    args = TrainerArgs(hf_checkpoint=path, lr=LR, micro_batch_size=2, **options)
    actor = TrainActor(args, master_port=port)
    try:
        assert actor.load_checkpoint(os.path.join(out_dir, "ckpt-ep2")) == 0
        torch.save(_next_step(actor, _batch(lengths, path)), os.path.join(out_dir, "resumed.pt"))
    finally:
        destroy_model_parallel()


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """The directory of every run's results: one process (EP 1), two ranks (EP 2, each checking
    its part of GLM-4.5 converted for EP 2), then one process resuming EP 2's checkpoint."""
    out = tmp_path_factory.mktemp("ep")
    jobs = {name: (checkpoints[name], opts, lengths) for name, (_, opts, lengths) in RUNS.items()}
    convert_cli(  # Megatron's flag name, as slime's conversion scripts take it
        [
            "hf-to-mcore",
            "--hf-checkpoint",
            checkpoints["glm4_moe"],
            "--save",
            str(out / "mcore-ep2"),
        ]
        + ["--expert-model-parallel-size", "2"]
    )
    _run(0, 1, _ports(len(jobs)), jobs, str(out))  # first: EP 2 resumes its checkpoint
    start_ranks(_run, (2, _ports(len(jobs)), jobs, str(out)), 2)
    _resume_at_ep1(jobs["deepseek_v3"], _ports(1)[0], str(out))
    return out


@pytest.fixture(scope="module")
def results(runs) -> dict[str, tuple]:
    """name -> (EP 2's, one process's) (log-probs before, metrics, log-probs after, weights)."""
    return {
        name: (torch.load(runs / f"{name}-ep2.pt"), torch.load(runs / f"{name}-ep1.pt"))
        for name in RUNS
    }


@pytest.mark.parametrize("name", sorted(RUNS))
def test_moe_trains_at_ep2_as_in_one_process(results, checkpoints, name):
    (before2, metrics2, after2, weights2), (before1, metrics1, after1, weights1) = results[name]
    assert _max_diff(before2, before1) < 1e-5
    assert metrics2.keys() == metrics1.keys()
    logged = {"glm4_moe": "train/mtp_loss", "deepseek_v3": "train/moe_seq_load_balancing_loss"}
    if name in logged:
        assert metrics1[logged[name]] > 0.1
    for key, value in metrics1.items():
        assert metrics2[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert _max_diff(after1, before1) > 0.1  # the step moved the policy ...
    assert _max_diff(after2, after1) < 1e-4  # ... as far at EP 2
    # every expert once, under its global number (HF names list each expert's tensors)
    assert weights2.keys() == weights1.keys()
    assert any(".mlp.experts.7.down_proj" in k for k in weights1)
    diffs = {k: (weights2[k] - weights1[k]).abs().max().item() for k in weights1}
    # Adam's first step moves each weight by about LR: a wrong expert's or a wrongly averaged
    # gradient moves it further than this.
    assert max(diffs.values()) < 0.2 * LR, max(diffs.items(), key=lambda kv: kv[1])
    if name == "deepseek_v3":  # --moe-router-bias-update-rate moved the bias the same way
        from trainer_bridge.convert import read_hf_weights

        initial = read_hf_weights(checkpoints[name])
        bias = [k for k in weights1 if k.endswith("e_score_correction_bias")]
        assert bias and all(diffs[k] == 0 for k in bias)
        assert all((weights2[k] - initial[k]).abs().max() > 0.5 * RATE for k in bias)


def test_a_checkpoint_resumes_at_another_ep_size(runs):
    """DeepSeek-V3 saved after its first step at EP 1 and at EP 2: the second step from EP 1's
    checkpoint at EP 2, and from EP 2's in a fresh process at EP 1, is the step the run that
    saved it took (its grad norm and losses, log-probs and every expert's weights after it)."""
    (next1,) = torch.load(runs / "next-ep1.pt")
    next2, from_ep1 = torch.load(runs / "next-ep2.pt")
    from_ep2 = torch.load(runs / "resumed.pt")
    for resumed, uninterrupted in ((from_ep1, next1), (from_ep2, next2)):
        metrics, after, weights = resumed
        assert metrics.keys() == uninterrupted[0].keys()
        for key, value in uninterrupted[0].items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        diffs = {k: (weights[k] - uninterrupted[2][k]).abs().max().item() for k in weights}
        # float32 sums in another order at the other EP size (measured: 1e-6, 1.2e-7); Adam's
        # state on the wrong expert, or its step lost, moves weights by a good part of LR
        assert _max_diff(after, uninterrupted[1]) < 1e-5
        assert max(diffs.values()) < 1e-3 * LR, max(diffs.items(), key=lambda kv: kv[1])


def test_what_does_not_split_over_experts_is_refused(checkpoints, tmp_path):
    from spec_engine.models.hf_config import ModelConfig
    from specrl.train_options import check_checkpoints, parse_args
    from trainer_bridge.checkpoint import FORMAT, V1_FORMAT, check_common
    from trainer_bridge.parallel.expert import check_expert_parallel

    arch = ModelConfig.load(checkpoints["glm4_moe"])
    with pytest.raises(ValueError, match="size 3 does not divide the 8 routed experts"):
        check_expert_parallel(arch, 3)
    base = (
        f"--hf-checkpoint {checkpoints['glm4_moe']} --prompt-data x.jsonl --rollout-batch-size 2 "
        f"--n-samples-per-prompt 2 --num-rollout 1 --output-dir {tmp_path} "
        "--expert-model-parallel-size 2 --actor-num-gpus-per-node "
    ).split()
    # before Ray: 3 trainer ranks do not hold whole expert groups of 2
    with pytest.raises(SystemExit, match="3 trainer ranks .* not a multiple of .* 1 x .* 2"):
        check_checkpoints(parse_args([*base, "3"]))
    with pytest.raises(SystemExit, match="--expert-tensor-parallel-size 2 with .*-size 1 is not"):
        check_checkpoints(parse_args([*base, "2", "--expert-tensor-parallel-size", "2"]))
    with pytest.raises(ValueError, match="dense model with none"):
        check_expert_parallel(dataclasses.replace(arch, moe=None), 2)
    # any EP size resumes (one from before EP: 1), but an older specrl's EP > 1 Adam layout not
    meta = {"format": FORMAT, "hf_config": arch.hf_config, "tensor_model_parallel_size": 1}
    check_common({"specrl": meta}, arch.hf_config, "ckpt")
    meta["format"] = V1_FORMAT
    check_common({"specrl": meta}, arch.hf_config, "ckpt")
    meta["expert_model_parallel_size"] = 2
    with pytest.raises(ValueError, match=r"older specrl .*-v1\) at --expert-model-parallel-size 2"):
        check_common({"specrl": meta}, arch.hf_config, "ckpt")
