"""Block-FP8 weights at --tp-size 2 on the CPU (two gloo ranks, rank 1 forked): a tiny DeepSeek-V3
(MLA by heads, routed and shared experts by features) and a tiny Qwen3 in DeepSeek-V3's FP8
release layout (tiny/releases.py, 16 x 16 blocks) decode as tp 1 (greedy tokens, log-probs
within 1e-4 in float32); each rank reads its slice of every split FP8 weight and the matching
slice of its `weight_scale_inv` grid, and holds what DeepSeek's weight_dequant makes of the whole
tensor (tests/support/fp8_reference.py), narrowed; updates from disk and from FP8 tensors with
their scales land as a fresh load. `--quantization fp8` quantizes each rank's block at load as
tp 1 quantizes the whole, and the trainer's pushes (tensor, distributed, disk) into it equal a
fresh FP8 load, checked by --check-weight-update-equal. A split that cuts an FP8 block is
refused before any rank starts, naming the weight and the sizes (SGLang's rule)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from spec_engine import Engine
from spec_engine.distributed.parallel_state import TPGroup, connect, use_tp_group
from spec_engine.models.hf_config import ModelConfig
from spec_engine.weights import fp8
from spec_engine.weights.loader import checkpoint_files, tensor_checksum, weight_spec
from tests.engine.test_tensor_parallel import (  # noqa: F401  (forked_ranks: a fixture)
    ENGINE,
    GREEDY,
    PROMPTS,
    forked_ranks,
)
from tests.support.fp8_reference import (
    dequantized_tensors,
    read_shards,
    weight_dequant,
    weight_quant,
)
from tests.support.safetensors_reads import record_reads
from tiny.releases import to_fp8_release
from trainer_bridge.weight_sync import WeightPusher, WeightSyncConfig

BLOCK = (16, 16)
# Every split a rank's block falls on block boundaries: DeepSeek-V3's q_b_proj 2 x 24 rows per
# rank, kv_b_proj 2 x 32, o_proj 32 columns, experts' 16 features; Qwen3's q 64 rows, k/v 32.
MODELS = {
    "deepseek_v3": dict(arch="deepseek_v3", num_layers=3),
    "qwen3": dict(arch="qwen3", head_dim=32),
}
# --quantization fp8 quantizes in DeepSeek-V3's 128 x 128 blocks: a Qwen3 whose every rank holds
# 128 rows of q, k, v, gate and up and 128 columns of o and down.
QWEN3_128 = dict(arch="qwen3", head_dim=128, num_heads=2, num_kv_heads=2, intermediate_size=256)


@pytest.fixture(scope="module")
def release(make_model, tmp_path_factory):
    """release(family, seed): the FP8 release of a tiny checkpoint, each written once."""
    made: dict[tuple[str, int], str] = {}

    def get(family: str, seed: int = 0) -> str:
        if (family, seed) not in made:
            src = make_model(**dict(MODELS[family], seed=seed))
            out = str(tmp_path_factory.mktemp(f"{family}-{seed}-fp8"))
            made[family, seed] = to_fp8_release(src, out, BLOCK)
        return made[family, seed]

    return get


def _generate(engine: Engine) -> tuple[list[list[int]], list[float]]:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    logprobs = [lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    return [o["output_ids"] for o in outs], logprobs


def _assert_same(one: tuple[list, list], two: tuple[list, list]) -> None:
    assert two[0] == one[0]
    assert max(abs(a - b) for a, b in zip(one[1], two[1])) < 1e-4


def _served(path: str) -> dict[str, str]:
    """Checksums of a fresh load of an FP8 release: its weights as DeepSeek's fp8_cast_bf16.py
    dequantizes them, in the engine's float32."""
    return {n: tensor_checksum(t.to(torch.float32)) for n, t in dequantized_tensors(path).items()}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_fp8_release_at_tp2_decodes_as_tp1_and_updates_as_a_fresh_load(family, release):
    old, new = release(family), release(family, seed=3)
    with Engine(model_path=old, tp_size=1, **ENGINE) as engine:
        one = _generate(engine)
    with Engine(model_path=old, tp_size=2, debug_tp_check_tokens=True, **ENGINE) as engine:
        assert engine.get_server_info()["weight_block_size"] == BLOCK
        _assert_same(one, _generate(engine))
        sums = engine.get_weights_checksum()
        assert sums == {n: s for n, s in _served(old).items() if n in sums}
        # From disk: each rank reads its slices of the new release's weights and scales.
        assert engine.update_weights_from_disk(new)["success"]
        assert engine.get_weights_checksum() == {n: s for n, s in _served(new).items() if n in sums}
        after = _generate(engine)
        # From tensors, FP8 with their scales as the release holds them (a trainer quantizing
        # before it sends): every rank dequantizes the whole and keeps its block.
        engine.update_weights_from_tensor(list(read_shards(old).items()))
        assert engine.get_weights_checksum() == sums
        assert _generate(engine)[0] == one[0]
    assert after[0] != one[0]


def test_each_rank_reads_its_slices_of_fp8_weights_and_scales(release, monkeypatch):
    from spec_engine.models.registry import model_class
    from spec_engine.weights.loader import build_model, hf_tensor

    path = release("deepseek_v3")
    whole, sliced = record_reads(monkeypatch)
    config = ModelConfig.from_pretrained(path)
    with use_tp_group(TPGroup(rank=1, size=2)):
        model = build_model(model_class(config), config, torch.float32, torch.device("cpu"), path)
    stored = read_shards(path)
    split = {  # name: the dimension split (rows of column-parallel, columns of row-parallel)
        "model.layers.1.self_attn.q_b_proj.weight": 0,
        "model.layers.1.self_attn.kv_b_proj.weight": 0,
        "model.layers.1.self_attn.o_proj.weight": 1,
        "model.layers.0.mlp.gate_proj.weight": 0,
        "model.layers.2.mlp.experts.5.up_proj.weight": 0,
        "model.layers.2.mlp.experts.5.down_proj.weight": 1,
        "model.layers.2.mlp.shared_experts.down_proj.weight": 1,
    }
    for name, dim in split.items():
        scale = name + "_scale_inv"
        assert stored[name].dtype == torch.float8_e4m3fn
        assert {name, scale} <= set(sliced) and not {name, scale} & set(whole), name
        full = weight_dequant(stored[name], stored[scale], BLOCK[0])
        half = full.shape[dim] // 2
        assert torch.equal(hf_tensor(model, name), full.narrow(dim, half, half))
    # Not split: read whole, with the whole scale grid (kv_a_proj_with_mqa's 40 rows cut short).
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert name in whole and name + "_scale_inv" in whole
    full = weight_dequant(stored[name], stored[name + "_scale_inv"], BLOCK[0])
    assert torch.equal(hf_tensor(model, name), full)


@pytest.fixture(scope="module")
def qwen3_pair(make_model) -> tuple[str, str]:
    return make_model(**QWEN3_128), make_model(**dict(QWEN3_128, seed=3))


def _fresh(path: str) -> tuple[tuple[list, list], dict[str, str]]:
    with Engine(model_path=path, tp_size=1, quantization="fp8", **ENGINE) as engine:
        return _generate(engine), engine.get_weights_checksum()


def test_quantized_at_load_per_rank_and_pushes_equal_a_fresh_fp8_load(qwen3_pair, tmp_path):
    old, new = qwen3_pair
    (one, sums), (fresh_new, _) = _fresh(old), _fresh(new)
    tensors = {path: load_file(checkpoint_files(path)[0]) for path in qwen3_pair}
    down = "model.layers.1.mlp.down_proj.weight"
    reference = weight_dequant(*weight_quant(tensors[old][down], 128), 128)
    with Engine(model_path=old, tp_size=2, quantization="fp8", **ENGINE) as engine:
        assert engine.get_server_info()["weight_block_size"] == (128, 128)
        _assert_same(one, _generate(engine))
        assert engine.get_weights_checksum() == sums
        assert engine.get_weights_checksum([down])[down] == tensor_checksum(reference)
        # The trainer's pushes (FP8 with scales by tensor and by broadcast, float32 on disk),
        # alternating between the two weights; each is verified by --check-weight-update-equal.
        for mode, path, expected in [
            ("tensor", new, fresh_new),
            ("distributed", old, one),
            ("disk", new, fresh_new),
        ]:
            cfg = WeightSyncConfig(weight_sync_mode=mode, check_weight_update_equal=True)
            pusher = WeightPusher([engine], cfg, output_dir=str(tmp_path))
            pusher.push(tensors[path].items(), version=mode)
            pusher.close()
            _assert_same(expected, _generate(engine))


def _args(tp: int) -> SimpleNamespace:
    return SimpleNamespace(tp_size=tp, ep_size=1, speculative_algorithm=None, device="cpu")


def test_a_split_inside_fp8_blocks_is_refused_naming_the_sizes(make_model, tmp_path):
    from spec_engine.args.tp_checks import check_tensor_parallel
    from spec_engine.weights.fp8 import scale_shard
    from spec_engine.weights.shard import Shard

    # head_dim 24: k_proj's 2 KV heads leave each rank 24 rows, half of a 16-row block over.
    src = make_model(arch="qwen3", head_dim=24)
    path = to_fp8_release(src, str(tmp_path / "fp8"), BLOCK)
    with pytest.raises(
        ValueError,
        match=r"--tp-size 2: FP8 weight 'model.layers.0.self_attn.k_proj.weight' of shape "
        r"\(48, 64\) is split .* into 24 rows per rank, which is not divisible by the FP8 "
        r"block's 16 \(weight_block_size \[16, 16\]\)",
    ):
        check_tensor_parallel(_args(2), ModelConfig.from_pretrained(path))
    # --quantization fp8's 128-row blocks do not fit the tiny Qwen3's 48 query rows per rank;
    # refused by the engine before rank 1 starts.
    with pytest.raises(ValueError, match=r"q_proj.weight. .* into 48 rows per rank.* 128"):
        Engine(model_path=src, tp_size=2, quantization="fp8", **ENGINE)
    with pytest.raises(ValueError, match=r"into 24 columns per rank.*block_k = 16"):
        scale_shard("x.down_proj.weight", Shard(1, 24, 24), (64, 48), BLOCK)
    assert scale_shard("x.down_proj.weight", Shard(1, 32, 32), (64, 64), BLOCK) == Shard(1, 2, 2)
    # Not split (one KV head on each of 2 ranks): its whole grid, the short edge block included.
    assert scale_shard("x.k_proj.weight", Shard(0, 0, 24), (24, 64), BLOCK) == Shard(0, 0, 2)


def _two_ranks(work: Callable[[TPGroup], Any]) -> list[Any]:
    """work(group) on ranks 0 and 1 of a gloo group, each a thread of this process (a real
    torch.distributed group over one store: a rank's updater gathers its checks and checksums
    from the other)."""
    store, results, errors = dist.HashStore(), [None, None], []

    def run(rank: int) -> None:
        try:
            results[rank] = work(
                connect(store, rank, 2, torch.device("cpu"), timedelta(seconds=30))
            )
        except BaseException as e:  # raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def _record_blocks(monkeypatch) -> tuple[dict[int, list[tuple[int, ...]]], dict[int, int]]:
    """(the shapes fp8.quantize and fp8.dequantize see by rank, the rank of each thread that
    records: a thread records once it is entered there)."""
    seen: dict[int, list[tuple[int, ...]]] = {0: [], 1: []}
    ranks: dict[int, int] = {}
    quantize, dequantize = fp8.quantize, fp8.dequantize

    def recorded(fn):
        def call(weight, *args):
            if threading.get_ident() in ranks:
                seen[ranks[threading.get_ident()]].append(tuple(weight.shape))
            return fn(weight, *args)

        return call

    monkeypatch.setattr(fp8, "quantize", recorded(quantize))
    monkeypatch.setattr(fp8, "dequantize", recorded(dequantize))
    return seen, ranks


@pytest.mark.parametrize("sent", ["fp8 with scales", "bf16 into --quantization fp8"])
def test_each_rank_dequantizes_or_quantizes_only_its_block_of_a_push(
    sent, release, qwen3_pair, monkeypatch
):
    """A push arrives whole on every rank; each rank takes its block first (an FP8 weight's with
    the same block of its scale grid) and (de)quantizes that alone, and the ranks then hold
    exactly what DeepSeek's weight_dequant (or weight_quant then weight_dequant) makes of the
    whole tensor."""
    from spec_engine.models.registry import model_class
    from spec_engine.weights.loader import build_model, hf_tensor
    from spec_engine.weights.updater import WeightUpdater

    if sent == "fp8 with scales":  # as a trainer quantizing before it sends (slime)
        path, new = release("deepseek_v3"), release("deepseek_v3", seed=3)
        config, update = ModelConfig.from_pretrained(path), read_shards(new)
        expected = {n: t.to(torch.float32) for n, t in dequantized_tensors(new).items()}
    else:
        path, new = qwen3_pair
        config = ModelConfig.from_pretrained(path)
        config = dataclasses.replace(config, weight_block_size=(128, 128))
        update = load_file(checkpoint_files(new)[0])
        expected = {n: t.to(torch.float32) for n, t in update.items()}
        for n, t in update.items():
            if fp8.is_quantized_linear(n):
                expected[n] = weight_dequant(*weight_quant(t, 128), 128)
    seen, ranks = _record_blocks(monkeypatch)

    def rank(group: TPGroup) -> tuple[dict[str, str], list[tuple[int, ...]]]:
        with use_tp_group(group):
            model = build_model(
                model_class(config), config, torch.float32, torch.device("cpu"), path
            )
        updater = WeightUpdater(model, torch.device("cpu"), tp=group)
        ranks[threading.get_ident()] = group.rank  # the load above is not recorded
        updater.apply(list(update.items()))
        spec = weight_spec(model)
        quantized = [n for n in update if fp8.is_quantized_linear(n) and spec[n].param is not None]
        held = [tuple(hf_tensor(model, n).shape) for n in quantized]
        return updater.checksums(), held

    results = _two_ranks(rank)
    for r, (_, held) in enumerate(results):
        # A split weight as the rank's block (kv_a_proj_with_mqa, not split, whole).
        wanted = held if sent == "fp8 with scales" else held + held  # quantize, then dequantize
        assert sorted(seen[r]) == sorted(wanted)
    sums = results[0][0]
    assert sums == results[1][0] == {n: tensor_checksum(expected[n]) for n in sums}


def test_a_bin_checkpoints_fp8_weights_are_narrowed_before_they_are_dequantized(
    release, monkeypatch, tmp_path
):
    """A pytorch_model.bin (memory-mapped, no slices to read) holding the FP8 release: rank 1
    narrows each split weight and its scale grid to its block first and dequantizes that alone,
    to the values it reads from the safetensors release (checked against DeepSeek's
    weight_dequant above)."""
    import shutil

    from spec_engine.models.registry import model_class
    from spec_engine.weights.loader import build_model, hf_tensor

    path = release("deepseek_v3")
    binary = str(tmp_path / "bin")
    shutil.copytree(path, binary, ignore=shutil.ignore_patterns("*.safetensors*"))
    stored = read_shards(path)
    torch.save(stored, f"{binary}/pytorch_model.bin")
    config = ModelConfig.from_pretrained(path)
    seen, ranks = _record_blocks(monkeypatch)
    models = []
    for source in (binary, path):  # the .bin load alone is recorded
        ranks[threading.get_ident()] = 1 if source == binary else 0
        with use_tp_group(TPGroup(rank=1, size=2)):
            cpu = torch.device("cpu")
            models.append(build_model(model_class(config), config, torch.float32, cpu, source))
    spec = weight_spec(models[0])
    fp8_weights = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    held = [n for n in fp8_weights if spec[n].param is not None]
    assert sorted(seen[1]) == sorted(tuple(hf_tensor(models[0], n).shape) for n in held)
    assert any(spec[n].shard is not None for n in held)
    for name in held:
        assert torch.equal(hf_tensor(models[0], name), hf_tensor(models[1], name)), name
