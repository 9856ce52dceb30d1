"""Weight pushes and weight reads at --tp-size 2 on the CPU (two gloo ranks, rank 1 spawned):
update_weights_from_distributed in the trainer's group of world size 3 (the trainer at rank 0,
engine rank r at rank_offset + r, as slime numbers them) lands on both ranks and a bad push
changes neither; checksums, get_weights_by_name and the weights checker report the whole
tensors, gathered, equal to the same engine at tp 1; at --ep-size 2 each rank receives every
tensor of a push and keeps its own experts, and the result is a fresh load."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from spec_engine import Engine
from spec_engine.weights.loader import tensor_checksum
from tests.conftest import FAMILIES
from trainer_bridge.megatron_compat import free_port


@pytest.fixture(scope="module", autouse=True)
def forked_ranks() -> Iterator[None]:
    """Rank 1 of each engine forked from tests/support/forkserver.py's server (torch and the
    engine imported) instead of spawned: a process of its own still, without seconds of imports."""
    from spec_engine.distributed import launch
    from tests.support.forkserver import instead_of_spawn

    with instead_of_spawn(launch):
        yield


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
ENGINE = dict(skip_tokenizer_init=True, max_total_tokens=256, device="cpu", log_level="warning")
# One KV head (replicated on both ranks) and a vocabulary of 511 (rank 1's block short): the
# gathers must put replicated and uneven blocks back where they belong.
LLAMA = dict(FAMILIES["llama"], vocab_size=511, num_kv_heads=1)
# Split along each way a rank holds a block: rows of q/k/v (k replicated), of gate/up and of the
# vocabulary; columns of o_proj and down_proj; norms whole.
READ = [
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
]


def _outputs(engine: Engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _trainer(port: int, pushes: list[dict[str, torch.Tensor]], errors: list) -> None:
    """Rank 0 of the weight-sync group of 3 (slime's trainer side): each push's tensors, one
    broadcast each, in order."""
    try:
        store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)
        group = dist.ProcessGroupGloo(dist.PrefixStore("w", store), 0, 3, timedelta(seconds=60))
        for tensors in pushes:
            for tensor in tensors.values():
                group.broadcast(tensor, 0).wait()
    except Exception as e:  # reported by the test, which would otherwise wait for the engine
        errors.append(e)


def test_distributed_push_reaches_both_ranks_and_a_bad_one_changes_neither(make_model):
    old, new = make_model(**LLAMA), make_model(**dict(LLAMA, seed=3))
    with Engine(model_path=new, tp_size=1, **ENGINE) as engine:
        expected = _outputs(engine)
    tensors = load_file(f"{new}/model.safetensors")
    # The NaN lies in rank 1's block (a column of down_proj's second half): rank 1 finds it in
    # its block and every rank refuses the update, naming rank 1.
    bad = {n: t.clone() for n, t in tensors.items()}
    bad["model.layers.0.mlp.down_proj.weight"][:, -1] = float("nan")
    port, errors = free_port(), []
    trainer = threading.Thread(target=_trainer, args=(port, [bad, tensors], errors))
    trainer.start()
    names = list(tensors)
    dtypes = [str(t.dtype) for t in tensors.values()]
    shapes = [list(t.shape) for t in tensors.values()]
    with Engine(model_path=old, tp_size=2, **ENGINE) as engine:
        before, sums = _outputs(engine), engine.get_weights_checksum()
        with pytest.raises(ValueError, match=r"rank_offset must be in 1\.\.1 .* got 2"):
            engine.init_weights_update_group("127.0.0.1", port, 2, 3, "w", "gloo")
        joined = engine.init_weights_update_group("127.0.0.1", port, 1, 3, "w", "gloo")
        assert joined["message"] == "joined 'w' (gloo) as ranks 1..2 of 3"
        with pytest.raises(ValueError, match="non-finite.*tensor-parallel rank 1; no rank updated"):
            engine.update_weights_from_distributed(names, dtypes, shapes, "w")
        assert engine.get_weights_checksum() == sums
        assert _outputs(engine) == before
        result = engine.update_weights_from_distributed(
            names, dtypes, shapes, "w", weight_version="v2"
        )
        trainer.join(30)
        assert not errors
        assert result["weight_version"] == "v2"
        assert _outputs(engine) == expected != before
        assert engine.get_weights_checksum() == {n: tensor_checksum(t) for n, t in tensors.items()}
        engine.destroy_weights_update_group("w")


def test_weight_reads_and_the_checker_gather_the_whole_tensors(make_model):
    path = make_model(**LLAMA)
    with Engine(model_path=path, tp_size=1, **ENGINE) as one:
        values = {n: one.get_weights_by_name(n, truncate_size=10**6) for n in READ}
        sums = one.get_weights_checksum()
        report = one.weights_checker("checksum")
    tensors = load_file(f"{path}/model.safetensors")
    with Engine(model_path=path, tp_size=2, **ENGINE) as two:
        assert {n: two.get_weights_by_name(n, truncate_size=10**6) for n in READ} == values
        assert two.get_weights_by_name("model.embed_tokens.weight", 7) == values[READ[0]][:7]
        assert two.get_weights_checksum() == sums
        assert two.weights_checker("checksum") == report
        assert two.weights_checker("snapshot")["success"]
        two.weights_checker("reset_tensors", skip_tensor_list=["lm_head"])
        assert two.get_weights_by_name("lm_head.weight", 10**6) == values["lm_head.weight"]
        failed = two.weights_checker("compare", skip_tensor_list=["lm_head"])
        assert not failed["success"] and "model.embed_tokens.weight" in failed["message"]
        two.update_weights_from_tensor(list(tensors.items()))
        assert two.weights_checker("compare")["success"]


def test_distributed_push_at_ep2_each_rank_keeps_its_experts(make_model):
    """--ep-size 2: both ranks join the trainer's group (ranks 1 and 2 of 3) and receive every
    tensor; each keeps its own experts (rank 0 experts 0-3, rank 1 experts 4-7) and the rest as
    at --ep-size 1; the result is a fresh load of the pushed checkpoint."""
    glm = FAMILIES["glm4_moe"]
    old, new = make_model(**glm), make_model(**dict(glm, seed=3))
    with Engine(model_path=new, tp_size=1, **ENGINE) as engine:
        expected = _outputs(engine)
    tensors = load_file(f"{new}/model.safetensors")  # the next-n layer too: taken, not used
    port, errors = free_port(), []
    trainer = threading.Thread(target=_trainer, args=(port, [tensors], errors))
    trainer.start()
    with Engine(model_path=old, tp_size=2, ep_size=2, **ENGINE) as engine:
        before = _outputs(engine)
        engine.init_weights_update_group("127.0.0.1", port, 1, 3, "w", "gloo")
        engine.update_weights_from_distributed(
            list(tensors),
            [str(t.dtype) for t in tensors.values()],
            [list(t.shape) for t in tensors.values()],
            "w",
        )
        trainer.join(30)
        assert not errors
        assert _outputs(engine) == expected != before
        # Checksums gather each expert from the rank that holds it: the pushed values.
        sums = engine.get_weights_checksum()
        assert {n for n in sums if ".experts.7." in n} and sums == {
            n: tensor_checksum(t) for n, t in tensors.items() if n in sums
        }
        assert len(sums) == len([n for n in tensors if not n.startswith("model.layers.3.")])
        # Rank 0 holds experts 0-3 alone: half of the eight experts' gate/up rows.
        w13 = dict(engine.runner.model.named_parameters())["model.layers.1.mlp.experts.w13_weight"]
        gate = tensors["model.layers.1.mlp.experts.0.gate_proj.weight"]
        assert w13.shape[0] == 4 * 2 * gate.shape[0]
        assert torch.equal(w13[: gate.shape[0]], gate)
        engine.destroy_weights_update_group("w")
