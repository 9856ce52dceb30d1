"""MoE models train at --expert-tensor-parallel-size 1 under tensor parallelism 2 (two spawned
gloo ranks, sequence parallel; slime's MoE recipes' ETP 1): every rank holds whole routed experts
and runs them on its own half of the sequence. DeepSeek-V3 (MLA, packed, the balance loss) at
EP 1, where the expert-data-parallel group is the two TP ranks; GLM-4.5 (grouped routing,
replayed routes, a next-n layer trained online) at EP 2, where one expert group spans the two TP
ranks (4 whole experts each), as slime's TP 4, EP 8, ETP 1 does. Against one process with the
same batch: log-probs before the step, one optimizer step's metrics (grad norm, losses), log-probs
and every expert's weights after it. Each rank loads its whole experts from Hugging Face and the
converter's --etp 1 file alike and exports them bit-exactly (rank 0 writes --save-hf with rank 1's
experts); DeepSeek-V3's checkpoint at ETP 1 resumes at ETP 2 (each expert split over the TP ranks
again) and takes the step the saving run took. Expert tensor parallel sizes that do not divide TP
are refused (those between 1 and TP: tests/trainer/test_moe_parallel4.py).

Measured: log-probs before the step 9.5e-7 off, grad norm rel 1e-8 (DeepSeek-V3) and 3e-7
(GLM-4.5), log-probs after 4.8e-6 / 1.9e-6, weights 0.029 / 0.013 LR; resumed at ETP 2: log-probs
4.8e-7, weights 1.2e-4 LR. Broken on purpose: the routed experts left to megatron's data-parallel
group (not marked for the expert-data-parallel one, which holds the TP ranks) fails DeepSeek-V3's
grad norm (rel 1.2e-4), log-probs after the step (0.041) and weights (2.0 LR), and its ETP 1
checkpoint no longer resumes bit for bit (the TP ranks' expert copies drifted apart); the export
all-gathering whole experts over TP as if they were slices fails the round trip; Hugging Face
weights loaded as TP slices of each expert are refused by the model (size mismatch)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import FAMILIES
from test_moe_ep import _assert_same_step, _check_loaded, _next_step, _step_and_export
from test_moe_tp import _batch, _max_diff, _ports

from tests.support.forkserver import start_ranks
from trainer_bridge.convert.__main__ import main as convert_cli

pytestmark = [
    pytest.mark.filterwarnings("ignore:::megatron"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU megatron tests"),
]
VOCAB = 300
LR = 1e-3
# name -> (checkpoint kwargs, trainer options, EP size at TP 2, sequence lengths)
RUNS = {
    "deepseek_v3": (
        dict(arch="deepseek_v3"),
        dict(qkv_format="thd", moe_aux_loss_coeff=1e-2),
        1,
        (12, 8),  # an even pack: the balance loss sees the same tokens at TP 1 and 2
    ),
    "glm4_moe": (
        FAMILIES["glm4_moe"],
        dict(qkv_format="bshd", enable_mtp_training=True, use_rollout_routing_replay=True),
        2,
        (11, 9),  # padded width 11: one more padding column at TP 2
    ),
}


@pytest.fixture(scope="module")
def checkpoints(make_model) -> dict[str, str]:
    return {name: make_model(**kw, vocab_size=VOCAB) for name, (kw, *_) in RUNS.items()}


def _actor(path: str, options: dict, world_size: int, rank: int, port: int, **sizes):
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.options import TrainerArgs

    args = TrainerArgs(hf_checkpoint=path, lr=LR, micro_batch_size=2, **options, **sizes)
    return TrainActor(args, rank=rank, world_size=world_size, master_port=port)


def _check_whole_experts(actor, ep: int) -> None:
    """Whole experts on this rank (num_experts / ep of them)."""
    experts = actor.gpt.decoder.layers[-1].mlp.experts.local_experts
    assert len(experts) == 8 // ep
    assert experts[0].linear_fc2.weight.shape[1] == actor.arch.moe.intermediate_size


def _run(rank: int, world_size: int, ports: list[int], jobs: dict, out_dir: str) -> None:
    """Each model on this rank of `world_size` (TP = world size, ETP 1): log-probs, one RL step,
    log-probs again and the exported weights; rank 0 saves them. DeepSeek-V3 then saves a
    checkpoint, steps on, and resumes from the checkpoint at ETP 2."""
    torch.set_num_threads(1)
    from trainer_bridge.megatron_compat import destroy_model_parallel

    for i, (name, (path, options, ep, lengths)) in enumerate(jobs.items()):
        sizes = {}
        if world_size > 1:
            sizes = dict(
                tensor_model_parallel_size=world_size,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=1,
            )
        actor = _actor(path, options, world_size, rank, ports[2 * i], **sizes)
        try:
            if world_size > 1:
                _check_whole_experts(actor, ep)
                _check_loaded(actor, path, os.path.join(out_dir, f"{name}-mcore"))
            batch = _batch(lengths, path)
            _step_and_export(actor, name, batch, out_dir, f"tp{world_size}")
            if world_size > 1 and name == "deepseek_v3":
                directory = os.path.join(out_dir, "ckpt-etp1")
                os.makedirs(directory, exist_ok=True)
                actor.save_checkpoint(directory, 0)
                step = _next_step(actor, batch)
                assert actor.load_checkpoint(directory) == 0  # at ETP 1 again: bit for bit
                _assert_same_step(_next_step(actor, batch), step)
        finally:
            destroy_model_parallel()
        if world_size > 1 and name == "deepseek_v3":
            sizes["expert_tensor_parallel_size"] = None  # TP's: experts split over TP again
            actor = _actor(path, options, world_size, rank, ports[2 * i + 1], **sizes)
            try:
                assert actor.load_checkpoint(directory) == 0
                if rank == 0:
                    resumed = _next_step(actor, batch)
                    torch.save((step, resumed), os.path.join(out_dir, "resumed.pt"))
                else:
                    _next_step(actor, batch)
            finally:
                destroy_model_parallel()


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """The directory of every run's results: each model converted for TP 2, ETP 1 (and its EP),
    one process (TP 1), then two ranks (TP 2, ETP 1)."""
    out = tmp_path_factory.mktemp("etp")
    jobs = {name: (checkpoints[name], opts, ep, n) for name, (_, opts, ep, n) in RUNS.items()}
    for name, (path, _, ep, _) in jobs.items():
        convert_cli(
            ["hf-to-mcore", "--hf-checkpoint", path, "--save", str(out / f"{name}-mcore")]
            + ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
            + ["--ep", str(ep)]
        )
    _run(0, 1, _ports(2 * len(jobs)), jobs, str(out))
    start_ranks(_run, (2, _ports(2 * len(jobs)), jobs, str(out)), 2)
    return out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_moe_trains_at_etp1_as_in_one_process(runs, name):
    before1, metrics1, after1, weights1 = torch.load(runs / f"{name}-tp1.pt")
    before2, metrics2, after2, weights2 = torch.load(runs / f"{name}-tp2.pt")
    assert _max_diff(before2, before1) < 1e-5
    assert metrics2.keys() == metrics1.keys()
    logged = {"glm4_moe": "train/mtp_loss", "deepseek_v3": "train/moe_seq_load_balancing_loss"}
    assert metrics1[logged[name]] > 0.1
    for key, value in metrics1.items():
        assert metrics2[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert _max_diff(after1, before1) > 0.1  # the step moved the policy ...
    assert _max_diff(after2, after1) < 1e-4  # ... as far at TP 2, ETP 1
    assert weights2.keys() == weights1.keys()
    assert any(".mlp.experts.7.down_proj" in k for k in weights1)
    diffs = {k: (weights2[k] - weights1[k]).abs().max().item() for k in weights1}
    # Adam's first step moves each weight by about LR: an expert gradient missing the other TP
    # rank's tokens moves it further than this.
    assert max(diffs.values()) < 0.2 * LR, max(diffs.items(), key=lambda kv: kv[1])


def test_an_etp1_checkpoint_resumes_at_etp2(runs):
    """DeepSeek-V3 saved at TP 2, ETP 1 after its first step, loaded at TP 2, ETP 2: the next
    step is the one the saving run took (grad norm, losses, log-probs, every expert's weights)."""
    (metrics, after, weights), (metrics2, after2, weights2) = torch.load(runs / "resumed.pt")
    assert metrics2.keys() == metrics.keys()
    for key, value in metrics.items():
        assert metrics2[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert _max_diff(after2, after) < 1e-5
    diffs = {k: (weights2[k] - weights[k]).abs().max().item() for k in weights}
    assert max(diffs.values()) < 1e-3 * LR, max(diffs.items(), key=lambda kv: kv[1])


def test_other_expert_tensor_parallel_sizes_are_refused(checkpoints, tmp_path, capsys):
    from spec_engine.models.hf_config import ModelConfig
    from specrl.train_options import check_checkpoints, parse_args
    from trainer_bridge.parallel.expert import check_expert_parallel

    arch = ModelConfig.load(checkpoints["glm4_moe"])
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 3 with .*-size 4 is not"):
        check_expert_parallel(arch, 1, 4, expert_tp=3)
    with pytest.raises(ValueError, match="not over data-parallel ranks; give a divisor of 1"):
        check_expert_parallel(arch, 1, 1, expert_tp=2)
    check_expert_parallel(
        arch, 1, 4, world_size=4, expert_tp=2
    )  # tests/trainer/test_moe_parallel4.py
    check_expert_parallel(arch, 2, 2, world_size=2, expert_tp=1)  # EP 2 spans the TP ranks
    base = (
        f"--hf-checkpoint {checkpoints['glm4_moe']} --prompt-data x.jsonl --rollout-batch-size 2 "
        f"--n-samples-per-prompt 2 --num-rollout 1 --output-dir {tmp_path} "
        "--tensor-model-parallel-size 2 --actor-num-gpus-per-node 2 "
        "--expert-tensor-parallel-size "
    ).split()
    with pytest.raises(SystemExit, match="2 trainer ranks .* 1 x --expert-model-parallel-size 4"):
        check_checkpoints(parse_args([*base, "1", "--expert-model-parallel-size", "4"]))
    with pytest.raises(SystemExit, match="--expert-tensor-parallel-size 3 with .* divisor of 2"):
        check_checkpoints(parse_args([*base, "3"]))
    with pytest.raises(SystemExit):
        convert_cli(
            ["hf-to-mcore", "--hf-checkpoint", checkpoints["glm4_moe"], "--save", str(tmp_path)]
            + ["--tp", "2", "--etp", "3"]
        )
    assert "--expert-tensor-parallel-size 3 with" in capsys.readouterr().err
