"""Tensor parallelism for the MoE families at --tp-size 2 on the CPU (two gloo ranks): GLM-4.5
and DeepSeek-V3, with every expert's intermediate features and the shared expert split over the
ranks and the router replicated (SGLang's placement at --ep-size 1) or half the experts whole on
each rank (--ep-size 2), and DeepSeek-V3's MLA split by heads over a latent cache per rank,
decode as tp 1 (greedy tokens, log-probs within 1e-4 in float32; decode steps in emulated
graphs) and as transformers, before and after a weight update from disk (then from tensors,
with checksums gathered over the ranks); each rank reads only its block of every expert (at
--ep-size 2 its experts) and of every per-head MLA projection off disk."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from spec_engine import Engine
from spec_engine.weights.loader import checkpoint_files, tensor_checksum
from tests.conftest import FAMILIES
from tests.engine.test_tensor_parallel import (  # noqa: F401  (forked_ranks: a fixture)
    ENGINE,
    GREEDY,
    PROMPTS,
    forked_ranks,
)
from tests.support.safetensors_reads import record_reads

# GLM-4.5 with q/k norms, two MoE layers after a dense one (first_k_dense_replace=1), a shared
# expert, grouped routing; its next-n layer sits in the checkpoint (skipped without speculation).
GLM = FAMILIES["glm4_moe"]
# DeepSeek-V3 with a query bottleneck (q_a_proj, q_b_proj), interleaved rope, a dense first layer.
DEEPSEEK = dict(arch="deepseek_v3", num_layers=3)
MODELS = {"glm4_moe": GLM, "deepseek_v3": DEEPSEEK}
# Decode steps in the CPU emulation of CUDA graphs (padded to 4, the all-reduce inside, checked
# against eager at startup): the MoE's dense expert loop, as captured graphs run it. GLM-4.5 runs
# them at --ep-size 1 and 2, DeepSeek-V3 at --ep-size 2 alone (they cost a second of CPU each).
GRAPHS = dict(cuda_graph_bs=[1, 4], cuda_graph_self_check=True, max_running_requests=4)
TP2 = {"glm4_moe": GRAPHS, "deepseek_v3": {}}


@pytest.fixture(scope="module")
def tp1():
    """tp1(path): what a tp-1 engine generates from the checkpoint, each engine started once."""
    outputs: dict[str, list[dict]] = {}

    def generate(path: str) -> list[dict]:
        if path not in outputs:
            with Engine(model_path=path, tp_size=1, **ENGINE) as engine:
                outputs[path] = engine.generate(
                    input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True
                )
        return outputs[path]

    return generate


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _assert_same(one: list[dict], two: list[dict]) -> None:
    for a, b in zip(one, two):
        assert b["output_ids"] == a["output_ids"]
        assert max(abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b))) < 1e-4


@pytest.mark.parametrize("family", sorted(MODELS))
def test_tp2_decodes_as_tp1_before_and_after_a_disk_update(family, make_model, hf, tp1):
    old, new = make_model(**MODELS[family]), make_model(**dict(MODELS[family], seed=3))
    with Engine(
        model_path=old, tp_size=2, debug_tp_check_tokens=True, **TP2[family], **ENGINE
    ) as engine:
        before = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        assert engine.update_weights_from_disk(new)["success"]
        after = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        # Checksums of the whole tensors, gathered from the ranks' blocks, are the checkpoint's.
        tensors = load_file(checkpoint_files(new)[0])
        sums = engine.get_weights_checksum()
        assert any(".experts.7.down_proj." in n for n in sums)
        assert sums == {n: tensor_checksum(tensors[n]) for n in sums}
        # From tensors (each rank takes its blocks of the whole ones): back to the old weights.
        engine.update_weights_from_tensor(list(load_file(checkpoint_files(old)[0]).items()))
        back = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in back] == [o["output_ids"] for o in before]
    _assert_same(tp1(old), before)
    _assert_same(tp1(new), after)
    assert [o["output_ids"] for o in before] != [o["output_ids"] for o in after]
    tokens, logprobs = hf.greedy(old, PROMPTS[0], GREEDY["max_new_tokens"])
    assert before[0]["output_ids"] == tokens
    assert max(abs(x - y) for x, y in zip(_logprobs(before[0]), logprobs)) < 1e-4


def test_each_rank_reads_only_its_block_of_every_expert(make_model, monkeypatch):
    from spec_engine.distributed.parallel_state import TPGroup, use_tp_group
    from spec_engine.models.hf_config import ModelConfig
    from spec_engine.models.registry import model_class
    from spec_engine.weights.loader import build_model

    path = make_model(**GLM)
    whole, _ = record_reads(monkeypatch)
    config = ModelConfig.from_pretrained(path)
    with use_tp_group(TPGroup(rank=1, size=2)):
        model = build_model(model_class(config), config, torch.float32, torch.device("cpu"), path)
    # (model.layers.3 is the next-n layer: the trunk skips it.)
    trunk = [n for n in whole if not n.startswith(f"model.layers.{config.num_hidden_layers}.")]
    assert [n for n in trunk if ".experts." in n or ".shared_experts." in n] == []
    with safe_open(checkpoint_files(path)[0], framework="pt") as f:
        get = f.get_tensor
        gate = get("model.layers.1.mlp.experts.5.gate_proj.weight")
        up = get("model.layers.1.mlp.experts.5.up_proj.weight")
        down = get("model.layers.1.mlp.experts.5.down_proj.weight")
        shared_up = get("model.layers.2.mlp.shared_experts.up_proj.weight")
        shared_down = get("model.layers.2.mlp.shared_experts.down_proj.weight")
        router = get("model.layers.1.mlp.gate.weight")
    inter, h = gate.shape[0] // 2, gate.shape[1]  # this rank's features, the hidden size
    p = dict(model.named_parameters())
    w13 = p["model.layers.1.mlp.experts.w13_weight"][5 * 2 * inter : 6 * 2 * inter]
    assert torch.equal(w13, torch.cat([gate[inter:], up[inter:]]))
    w2 = p["model.layers.1.mlp.experts.w2_weight"][5 * h : 6 * h]
    assert torch.equal(w2, down[:, inter:])
    shared = p["model.layers.2.mlp.shared_experts.gate_up_proj.weight"]
    assert torch.equal(shared[shared.shape[0] // 2 :], shared_up[shared_up.shape[0] // 2 :])
    half = shared_down.shape[1] // 2
    assert torch.equal(
        p["model.layers.2.mlp.shared_experts.down_proj.weight"], shared_down[:, half:]
    )
    assert torch.equal(p["model.layers.1.mlp.gate.weight"], router)  # the router whole


def test_moe_intermediate_size_that_does_not_divide_is_refused_before_any_rank_starts(make_model):
    from spec_engine.args.tp_checks import check_tensor_parallel
    from spec_engine.models.hf_config import ModelConfig

    path = make_model(**dict(GLM, extra_config=dict(GLM["extra_config"], moe_intermediate_size=33)))
    args = SimpleNamespace(tp_size=2, ep_size=1, speculative_algorithm=None, device="cpu")
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(33\) is not divisible by"):
        check_tensor_parallel(args, ModelConfig.from_pretrained(path))


@pytest.mark.parametrize("q_lora", [True, False])
def test_each_rank_reads_only_its_heads_of_mla(q_lora, make_model, monkeypatch):
    """Rank 1 of 2 takes the second half of the heads of q_b_proj (q_proj without a query
    bottleneck), kv_b_proj (rows) and o_proj (columns), as slices; the latent projections are
    whole on every rank."""
    from spec_engine.distributed.parallel_state import TPGroup, use_tp_group
    from spec_engine.models.hf_config import ModelConfig
    from spec_engine.models.registry import model_class
    from spec_engine.weights.loader import build_model

    path = make_model(
        **(DEEPSEEK if q_lora else dict(DEEPSEEK, extra_config={"q_lora_rank": None}))
    )
    whole, sliced = record_reads(monkeypatch)
    config = ModelConfig.from_pretrained(path)
    with use_tp_group(TPGroup(rank=1, size=2)):
        model = build_model(model_class(config), config, torch.float32, torch.device("cpu"), path)
    attn = "model.layers.1.self_attn."
    q = "q_b_proj" if q_lora else "q_proj"
    for name in (q, "kv_b_proj", "o_proj"):
        assert f"{attn}{name}.weight" in sliced and f"{attn}{name}.weight" not in whole
    p = dict(model.named_parameters())
    with safe_open(checkpoint_files(path)[0], framework="pt") as f:
        for name, dim in ((q, 0), ("kv_b_proj", 0), ("o_proj", 1)):
            full = f.get_tensor(f"{attn}{name}.weight")
            half = full.shape[dim] // 2
            assert torch.equal(p[f"{attn}{name}.weight"], full.narrow(dim, half, half))
        for name in ("q_a_proj", "kv_a_proj_with_mqa")[1 - q_lora :]:
            assert torch.equal(p[f"{attn}{name}.weight"], f.get_tensor(f"{attn}{name}.weight"))


@pytest.mark.parametrize("family", sorted(MODELS))
def test_ep2_decodes_as_tp1_before_and_after_a_disk_update(family, make_model, tp1):
    """--ep-size 2: each rank holds half the experts whole (the shared expert still split by
    features; DeepSeek-V3's MLA by heads); equal to tp 1, before and after an update from disk,
    decode steps in emulated graphs. Weights read whole come from the rank that holds them:
    checksums of every tensor equal the checkpoint's, and an expert of rank 1's half reads as
    the checkpoint's."""
    old, new = make_model(**MODELS[family]), make_model(**dict(MODELS[family], seed=3))
    kwargs = dict(tp_size=2, ep_size=2, debug_tp_check_tokens=True, **GRAPHS, **ENGINE)
    with Engine(model_path=old, **kwargs) as engine:
        assert engine.get_server_info()["ep_size"] == 2
        before = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        assert engine.update_weights_from_disk(new)["success"]
        after = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        tensors = load_file(checkpoint_files(new)[0])
        # (GLM-4.5's model.layers.3 is its next-n layer: the trunk skips it.)
        trunk = {n: t for n, t in tensors.items() if not n.startswith("model.layers.3.")}
        assert engine.get_weights_checksum() == {n: tensor_checksum(t) for n, t in trunk.items()}
        name = "model.layers.2.mlp.experts.6.down_proj.weight"  # rank 1's (experts 4-7)
        values = engine.get_weights_by_name(name, truncate_size=tensors[name].numel())
        assert values == tensors[name].reshape(-1).tolist()
        # slime's --check-weight-update-equal: snapshot, every weight but that expert reset to
        # NaN, compared before and after an update (from tensors: each rank takes its experts).
        assert engine.weights_checker("snapshot")["success"]
        engine.weights_checker("reset_tensors", skip_tensor_list=[name])
        assert engine.get_weights_by_name(name, truncate_size=len(values)) == values
        assert not engine.weights_checker("compare")["success"]
        assert engine.update_weights_from_tensor(list(tensors.items()))["success"]
        assert engine.weights_checker("compare")["success"]
    _assert_same(tp1(old), before)
    _assert_same(tp1(new), after)


def test_at_ep2_each_rank_reads_only_its_experts_whole(make_model, monkeypatch):
    from spec_engine.distributed.parallel_state import TPGroup, use_tp_group
    from spec_engine.models.hf_config import ModelConfig
    from spec_engine.models.registry import model_class
    from spec_engine.weights.loader import build_model

    path = make_model(**GLM)
    whole, _ = record_reads(monkeypatch)  # (slices: also every header read, for shapes)
    config = ModelConfig.from_pretrained(path)
    with use_tp_group(TPGroup(rank=1, size=2, ep_size=2)):
        model = build_model(model_class(config), config, torch.float32, torch.device("cpu"), path)
    layer = "model.layers.1.mlp."
    read = {n for n in whole if n.startswith(layer + "experts.")}
    assert {int(n.split(".")[5]) for n in read} == {4, 5, 6, 7}  # rank 1's, whole; not 0-3
    p = dict(model.named_parameters())
    with safe_open(checkpoint_files(path)[0], framework="pt") as f:
        gate, up = (f.get_tensor(f"{layer}experts.5.{n}_proj.weight") for n in ("gate", "up"))
        down = f.get_tensor(f"{layer}experts.5.down_proj.weight")
    inter, h = gate.shape
    # Expert 5 is this rank's second (index 1).
    w13 = p[f"{layer}experts.w13_weight"][2 * inter : 4 * inter]
    assert torch.equal(w13, torch.cat([gate, up]))
    assert torch.equal(p[f"{layer}experts.w2_weight"][h : 2 * h], down)
    assert p[f"{layer}experts.w13_weight"].shape[0] == 4 * 2 * inter


def test_at_ep2_a_disk_update_reads_only_this_ranks_experts(make_model, monkeypatch):
    """Rank 1 of --ep-size 2 updating from disk reads experts 4-7 whole and never 0-3 (in the
    check pass or the copy pass), takes the new checkpoint's values for them, and reports the
    bytes it read: its own tensors' (nor the next-n layer the trunk skips)."""
    from spec_engine.distributed.parallel_state import TPGroup, use_tp_group
    from spec_engine.models.hf_config import ModelConfig
    from spec_engine.models.registry import model_class
    from spec_engine.weights.loader import build_model, hf_tensor, weight_spec
    from spec_engine.weights.updater import WeightUpdater

    old, new = make_model(**GLM), make_model(**dict(GLM, seed=3))
    config = ModelConfig.from_pretrained(old)
    with use_tp_group(TPGroup(rank=1, size=2, ep_size=2)):
        model = build_model(model_class(config), config, torch.float32, torch.device("cpu"), old)
    whole, _ = record_reads(monkeypatch)  # (slices: also every header read, for shapes)
    # This rank's side of the update (the ranks' verdicts are gathered only at tp > 1).
    received = WeightUpdater(model, torch.device("cpu")).from_disk(new)
    layer = "model.layers.1.mlp.experts."
    read = {n for n in whole if n.startswith(layer)}
    assert {int(n.split(".")[5]) for n in read} == {4, 5, 6, 7}
    with safe_open(checkpoint_files(new)[0], framework="pt") as f:
        for name in sorted(n for n in f.keys() if n.startswith(layer)):
            held = weight_spec(model)[name].param is not None
            assert held == (int(name.split(".")[5]) >= 4)
            if held:
                assert torch.equal(hf_tensor(model, name), f.get_tensor(name))
    mine = [n for n, slot in weight_spec(model).items() if slot.param is not None]
    assert received == sum(hf_tensor(model, n).numel() * 4 for n in mine)


@pytest.mark.parametrize(
    "ep_size, tp_size, match",
    [
        (2, 1, r"--ep-size 2 with --tp-size 1: .* must divide --tp-size; .* one of \[1\]"),
        (3, 4, r"--ep-size 3 with --tp-size 4: .* one of \[1, 2, 4\]"),
        (3, 3, "--ep-size 3: the 8 routed experts do not split evenly into 3 groups"),
    ],
)
def test_ep_sizes_that_do_not_fit_are_refused(ep_size, tp_size, match, make_model):
    from spec_engine.args.tp_checks import check_expert_parallel
    from spec_engine.models.hf_config import ModelConfig

    with pytest.raises(ValueError, match=match):
        check_expert_parallel(ep_size, tp_size, ModelConfig.from_pretrained(make_model(**GLM)))


@pytest.mark.parametrize("family", sorted(MODELS))
def test_ep2_at_tp4_decodes_as_tp1_and_updates(family, make_model, tp1):
    """--tp-size 4 --ep-size 2 (SGLang's moe_tp_size 2): ranks 0-1 hold experts 0-3, ranks 2-3
    experts 4-7, each its half of their features; attention, the shared expert and the dense
    MLP split four ways. Equal to tp 1; checksums gather each expert from its group's ranks;
    an update from tensors lands on every rank's blocks."""
    old, new = make_model(**MODELS[family]), make_model(**dict(MODELS[family], seed=3))
    with Engine(model_path=old, tp_size=4, ep_size=2, debug_tp_check_tokens=True, **ENGINE) as e:
        assert e.get_server_info()["ep_size"] == 2
        before = e.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        tensors = load_file(checkpoint_files(new)[0])
        e.update_weights_from_tensor(list(tensors.items()))
        trunk = {n: t for n, t in tensors.items() if not n.startswith("model.layers.3.")}
        assert e.get_weights_checksum() == {n: tensor_checksum(t) for n, t in trunk.items()}
        after = e.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    _assert_same(tp1(old), before)
    _assert_same(tp1(new), after)


def test_at_tp4_ep2_a_rank_holds_its_groups_experts_block(make_model, monkeypatch):
    """Rank 2 of --tp-size 4 --ep-size 2 (SGLang's layout: ranks 2-3 share expert group 1):
    experts 4-7, the first half of their features, read as slices; no expert of group 0 read."""
    from spec_engine.distributed.parallel_state import TPGroup, use_tp_group
    from spec_engine.models.hf_config import ModelConfig
    from spec_engine.models.registry import model_class
    from spec_engine.weights.loader import build_model

    path = make_model(**GLM)
    whole, _ = record_reads(monkeypatch)
    config = ModelConfig.from_pretrained(path)
    with use_tp_group(TPGroup(rank=2, size=4, ep_size=2)):
        model = build_model(model_class(config), config, torch.float32, torch.device("cpu"), path)
    layer = "model.layers.1.mlp."
    assert [n for n in whole if n.startswith(layer + "experts.")] == []
    p = dict(model.named_parameters())
    with safe_open(checkpoint_files(path)[0], framework="pt") as f:
        gate, up = (f.get_tensor(f"{layer}experts.5.{n}_proj.weight") for n in ("gate", "up"))
        down = f.get_tensor(f"{layer}experts.5.down_proj.weight")
    inter, h = gate.shape[0] // 2, gate.shape[1]
    assert p[f"{layer}experts.w13_weight"].shape == (4 * 2 * inter, h)
    # Expert 5 is this rank's second (index 1); its features' first half.
    w13 = p[f"{layer}experts.w13_weight"][2 * inter : 4 * inter]
    assert torch.equal(w13, torch.cat([gate[:inter], up[:inter]]))
    assert torch.equal(p[f"{layer}experts.w2_weight"][h : 2 * h], down[:, :inter])
