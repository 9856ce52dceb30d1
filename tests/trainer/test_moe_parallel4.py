"""MoE layouts that need four ranks (four spawned gloo ranks; tiny DeepSeek-V3: MLA, packed
sequences, megatron's balance loss and the expert-bias update), each against one process with the
same global batch:

* TP 4, ETP 2 (EP 1): each routed expert split over two of the four TP ranks, TP rank r holding
  slice r % 2 as megatron lays the expert tensor parallel ranks out, the ranks holding the same
  slice ({0, 2}, {1, 3}) summing its gradient (the expert-data-parallel group);
* TP 2, EP 4, ETP 1: one expert group of four ranks over two TP groups (data-parallel size 2),
  each rank holding 2 of the 8 routed experts whole: expert parallelism larger than TP at more
  than two ranks, as slime's TP 4, EP 8, ETP 1 recipes run.

Each rank loads what the converter writes for it (`hf-to-mcore --tp 4 --etp 2`, `--tp 2 --ep 4
--etp 1`) and exports the Hugging Face weights bit-exactly; log-probs before the step, one
optimizer step's metrics (grad norm, losses), log-probs after it and every expert's weights equal
one process's; the TP 4, ETP 2 checkpoint resumes in one process and takes the step the saving
run took.

Broken on purpose, each fails here: TP rank r holding expert slice r // 2 instead of r % 2 (the
export, the converter's round trip), the expert gradients left to the data-parallel group instead
of the expert-data-parallel one (grad norm 6.1576 against 6.1592, the resumed step)."""

from __future__ import annotations

import os

import pytest
import torch
from test_moe_ep import (
    LR,
    RUNS,
    VOCAB,
    _batch,
    _check_loaded,
    _next_step,
    _step_and_export,
)
from test_moe_tp import _max_diff, _ports

from tests.support.forkserver import start_ranks
from trainer_bridge.convert.__main__ import main as convert_cli

pytestmark = [
    pytest.mark.filterwarnings("ignore:::megatron"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU megatron tests"),
]
CHECKPOINT_KWARGS, OPTIONS, LENGTHS = RUNS["deepseek_v3"]
# tag -> (trainer sizes, the converter's flags for them)
LAYOUTS = {
    "tp4-etp2": (
        dict(tensor_model_parallel_size=4, expert_tensor_parallel_size=2),
        ["--tp", "4", "--etp", "2"],
    ),
    "tp2-ep4": (
        dict(
            tensor_model_parallel_size=2,
            expert_model_parallel_size=4,
            expert_tensor_parallel_size=1,
        ),
        ["--tp", "2", "--ep", "4", "--etp", "1"],
    ),
}


def _actor(path: str, world_size: int, rank: int, port: int, **sizes):
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.options import TrainerArgs

    args = TrainerArgs(hf_checkpoint=path, lr=LR, micro_batch_size=2, **OPTIONS, **sizes)
    return TrainActor(args, rank=rank, world_size=world_size, master_port=port)


def _run(rank: int, world_size: int, ports: list[int], path: str, out_dir: str) -> None:
    """One process: the reference step. Four ranks: each layout's step and export; TP 4, ETP 2
    then saves a checkpoint and takes a second step (rank 0 keeps it)."""
    torch.set_num_threads(1)
    from trainer_bridge.megatron_compat import destroy_model_parallel

    layouts = LAYOUTS.items() if world_size > 1 else [("tp1", ({}, []))]
    batch = _batch(LENGTHS, path)
    for port, (tag, (sizes, _)) in zip(ports, layouts):
        actor = _actor(path, world_size, rank, port, **sizes)
        try:
            if world_size > 1:
                _check_loaded(actor, path, os.path.join(out_dir, f"mcore-{tag}"))
            _step_and_export(actor, "deepseek_v3", batch, out_dir, tag)
            if tag == "tp4-etp2":
                directory = os.path.join(out_dir, "ckpt-tp4-etp2")
                os.makedirs(directory, exist_ok=True)
                actor.save_checkpoint(directory, 0)
                step = _next_step(actor, batch)
                if rank == 0:
                    torch.save(step, os.path.join(out_dir, "next-tp4-etp2.pt"))
        finally:
            destroy_model_parallel()


@pytest.fixture(scope="module")
def runs(make_model, tmp_path_factory):
    """The results directory: the converter's files for each layout, one process's step, the
    four ranks' steps, and one process's step from the TP 4, ETP 2 checkpoint."""
    path = make_model(**CHECKPOINT_KWARGS, vocab_size=VOCAB)
    out = tmp_path_factory.mktemp("parallel4")
    for tag, (_, flags) in LAYOUTS.items():
        convert_cli(
            ["hf-to-mcore", "--hf-checkpoint", path, "--save", str(out / f"mcore-{tag}"), *flags]
        )
    _run(0, 1, _ports(1), path, str(out))
    start_ranks(_run, (4, _ports(len(LAYOUTS)), path, str(out)), 4)
    from trainer_bridge.megatron_compat import destroy_model_parallel

    actor = _actor(path, 1, 0, _ports(1)[0])
    try:
        assert actor.load_checkpoint(str(out / "ckpt-tp4-etp2")) == 0
        torch.save(_next_step(actor, _batch(LENGTHS, path)), out / "resumed.pt")
    finally:
        destroy_model_parallel()
    return out


@pytest.mark.parametrize("tag", sorted(LAYOUTS))
def test_moe_trains_at_four_ranks_as_in_one_process(runs, tag):
    before1, metrics1, after1, weights1 = torch.load(runs / "deepseek_v3-tp1.pt")
    before4, metrics4, after4, weights4 = torch.load(runs / f"deepseek_v3-{tag}.pt")
    assert _max_diff(before4, before1) < 1e-5
    assert metrics4.keys() == metrics1.keys()
    assert metrics1["train/moe_seq_load_balancing_loss"] > 0.1
    for key, value in metrics1.items():
        assert metrics4[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert _max_diff(after1, before1) > 0.1  # the step moved the policy ...
    assert _max_diff(after4, after1) < 1e-4  # ... as far at four ranks
    assert weights4.keys() == weights1.keys()
    assert any(".mlp.experts.7.down_proj" in k for k in weights1)
    diffs = {k: (weights4[k] - weights1[k]).abs().max().item() for k in weights1}
    # Adam's first step moves each weight by about LR: an expert gradient missing another
    # rank's tokens moves it further than this.
    assert max(diffs.values()) < 0.2 * LR, max(diffs.items(), key=lambda kv: kv[1])


def test_a_tp4_etp2_checkpoint_resumes_in_one_process(runs):
    """Saved at TP 4, ETP 2 after the first step, loaded by one process: the next step is the
    one the saving run took (grad norm, losses, log-probs, every expert's weights)."""
    metrics, after, weights = torch.load(runs / "next-tp4-etp2.pt")
    metrics1, after1, weights1 = torch.load(runs / "resumed.pt")
    assert metrics1.keys() == metrics.keys()
    for key, value in metrics.items():
        assert metrics1[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert _max_diff(after1, after) < 1e-4
    diffs = {k: (weights1[k] - weights[k]).abs().max().item() for k in weights}
    assert max(diffs.values()) < 0.2 * LR, max(diffs.items(), key=lambda kv: kv[1])


def test_experts_split_over_part_of_the_tp_ranks_round_trip(make_model, tmp_path):
    """The converter at TP 4, ETP 2 (and EP 2): TP rank r holds slice r % 2 of every routed
    expert, the other tensors as at ETP 4; back to Hugging Face bit for bit."""
    from trainer_bridge.convert import load_mcore_rank, read_hf_weights, read_mcore_as_hf

    path = make_model(**CHECKPOINT_KWARGS, vocab_size=VOCAB)
    for etp in ("2", "4"):
        convert_cli(
            ["hf-to-mcore", "--hf-checkpoint", path, "--save", str(tmp_path / etp)]
            + ["--tp", "4", "--ep", "2", "--etp", etp]
        )
    split = [[load_mcore_rank(str(tmp_path / "2"), r, ep) for r in range(4)] for ep in (0, 1)]
    full = [[load_mcore_rank(str(tmp_path / "4"), r, ep) for r in range(4)] for ep in (0, 1)]
    expert = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"
    for ep in (0, 1):
        assert split[ep][0][expert].shape[1] == 2 * full[ep][0][expert].shape[1]
        for r in range(4):
            assert torch.equal(split[ep][r][expert], split[ep][r % 2][expert])
            assert not torch.equal(split[ep][r][expert], split[ep][1 - r % 2][expert])
            dense = "decoder.layers.0.mlp.linear_fc2.weight"
            assert torch.equal(split[ep][r][dense], full[ep][r][dense])
    _, tensors = read_mcore_as_hf(str(tmp_path / "2"))
    initial = read_hf_weights(path)
    assert tensors.keys() == initial.keys()
    assert [k for k in initial if not torch.equal(tensors[k], initial[k])] == []
