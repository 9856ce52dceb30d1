"""Graph batch sizes, padding and replay: replayed runs equal eager runs, for plain decoding and
every speculative algorithm, as the running batch shrinks through every size (CPU: the graphs
are emulated over the same static buffers and metadata a CUDA graph replays), and the CPU
emulation catches what would break a real CUDA graph."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

from spec_engine import Engine
from spec_engine.args.engine_args import EngineArgs
from spec_engine.core import memory
from spec_engine.forward_batch import causal_mask, padded_masks
from spec_engine.runner.graph_runner import GraphRunner, capture_sizes, default_capture_sizes
from spec_engine.runner.self_check import SelfCheckBatches
from tests.conftest import random_prompts
from tests.engine.test_speculative import models, spec_args  # noqa: F401  (module fixture)

ALGOS = {
    "plain": None,
    "eagle-tree": "eagle-tree",
    "eagle3": "eagle3-draft-vocab",
    "mtp": "mtp",
    "standalone": "standalone",
    "ngram": "ngram",
}
GRAPH_SETTINGS = {
    "bs-1-3-8": dict(cuda_graph_bs=[8, 3, 1, 3], cuda_graph_self_check=True),
    "bs-1-2-4": dict(cuda_graph_bs=[1, 2, 4], cuda_graph_self_check=True),
    "no-padding": dict(
        cuda_graph_bs=[1, 3, 8], disable_cuda_graph_padding=True, cuda_graph_self_check=True
    ),
}
# Ten requests whose lengths differ by more than a step can emit, so the batch shrinks 10 -> 1.
LENGTHS = [2 + 8 * i for i in range(10)]


def test_default_capture_list_is_dense_and_reaches_the_max():
    assert default_capture_sizes(10) == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert default_capture_sizes(11) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]
    sizes = default_capture_sizes(300)
    assert sizes[:8] == list(range(1, 9)) and sizes[-1] == 300
    steps = {b - a for a, b in zip(sizes, sizes[1:])}
    assert steps == {1, 2, 4, 8, 12, 16}  # 288 -> 300 is the cap
    assert capture_sizes(None, None, 48)[-1] == 48
    assert capture_sizes([8, 1, 3, 3, 64], None, 10) == [1, 3, 8]
    with pytest.raises(ValueError, match="exceeds --max-running-requests 10"):
        capture_sizes([16, 32], None, 10)
    with pytest.raises(ValueError, match="--cuda-graph-bs must be a positive integer, got 0"):
        EngineArgs(model_path="x", cuda_graph_bs=[1, 0])


def _record_sizes(monkeypatch) -> list[tuple[str, int, int | None]]:
    seen = []
    original = GraphRunner.pad

    def pad(self, batch, features=None, size=None):
        out = original(self, batch, features, size)
        if size is not None:  # the startup self-check
            return out
        seen.append(
            (
                self.label,
                self.num_requests(batch),
                None if out is None else out.batch.batch_size // (1 if self.extend else self.width),
            )
        )
        return out

    monkeypatch.setattr(GraphRunner, "pad", pad)
    return seen


def _engine_kwargs(models, algo):  # noqa: F811
    if ALGOS[algo] is None:
        return models["target"], {}
    return spec_args(models, ALGOS[algo])


_EAGER: dict = {}


def _run(path, kwargs, params):
    prompts = random_prompts(10, 6, 14, seed=3)
    with Engine(model_path=path, random_seed=0, max_running_requests=10, **kwargs) as engine:
        return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)


@pytest.mark.parametrize("setting", list(GRAPH_SETTINGS))
@pytest.mark.parametrize("algo", list(ALGOS))
def test_shrinking_batch_equals_eager(models, algo, setting, monkeypatch):  # noqa: F811
    path, kwargs = _engine_kwargs(models, algo)
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in LENGTHS]
    if algo not in _EAGER:
        _EAGER[algo] = _run(path, dict(kwargs, disable_cuda_graph=True), params)
    seen = _record_sizes(monkeypatch)
    outs = _run(path, dict(kwargs, **GRAPH_SETTINGS[setting]), params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in _EAGER[algo]]
    diffs = [
        abs(a[0] - b[0])
        for o, r in zip(outs, _EAGER[algo])
        for a, b in zip(
            o["meta_info"]["output_token_logprobs"], r["meta_info"]["output_token_logprobs"]
        )
    ]
    assert max(diffs) < 1e-4
    main = "target decode" if algo == "plain" else "target target_verify"
    runs = [(num, size) for label, num, size in seen if label == main]
    sizes = GRAPH_SETTINGS[setting]["cuda_graph_bs"]
    padding = not GRAPH_SETTINGS[setting].get("disable_cuda_graph_padding", False)
    assert {num for num, _ in runs} == set(range(1, 11))
    for num, size in runs:
        fits = [s for s in sizes if s >= num]
        expected = (min(fits) if padding else (num if num in sizes else None)) if fits else None
        assert size == expected, (num, size)
    if algo != "plain" and algo != "ngram":
        assert any(label.startswith("draft") and size is not None for label, _, size in seen)


def test_sampled_outputs_equal_eager(models):  # noqa: F811
    path, kwargs = spec_args(models, "eagle-tree")
    params = [
        {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": n, "ignore_eos": True} for n in LENGTHS
    ]
    eager = _run(path, dict(kwargs, disable_cuda_graph=True), params)
    padded = _run(path, dict(kwargs, cuda_graph_bs=[2, 5]), params)
    assert [o["output_ids"] for o in padded] == [o["output_ids"] for o in eager]


def test_padded_rows_are_inert(llama_path):
    """Padded rows write only the dummy slot, sit at position 0 with the fill length and the
    dummy table row, and extend-mode masks give real rows no padded key."""
    with Engine(
        model_path=llama_path,
        random_seed=0,
        max_running_requests=8,
        cuda_graph_bs=[4],
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,
    ) as engine:
        runner = engine.runner
        dummy = runner.req_to_token_pool.dummy_row
        assert runner.req_to_token_pool.req_to_token[dummy].abs().sum() == 0
        decode, verify = runner.graphs  # target decode, target verify
        batches = SelfCheckBatches(
            runner.req_to_token_pool, runner.allocator, [runner.kv_pool], 100, runner.device
        )
        try:
            for _ in range(2):  # a second pad must not leave values from the first in padded rows
                batch, _ = batches.make(decode, 3, None)
                batch.positions += 7
                p = decode.pad(batch)
                assert p.batch.batch_size == 4
                assert p.batch.out_cache_loc[3] == 0 and p.batch.positions[3] == 0
                assert p.batch.req_pool_indices[3] == dummy and p.batch.seq_lens[3] == 1
                assert p.batch.out_cache_loc[:3].tolist() == batch.out_cache_loc.tolist()
            batch, _ = batches.make(verify, 2, None)  # 3 tokens each, width 4
            p = verify.pad(batch)
            assert p.token_rows.tolist() == [0, 1, 2, 4, 5, 6]
            assert p.batch.out_cache_loc[[3, 7, 8, 9, 10, 11]].tolist() == [0] * 6
            assert (
                p.batch.extend_seq_lens_cpu == [4] * 4
                and p.batch.req_pool_indices[2:].tolist() == [dummy] * 2
            )
            mask = p.batch.custom_masks[0]  # prefix 2 + width 4 keys
            assert (
                mask.shape == (4, 6)
                and not mask[:3, 5].any()
                and mask[3].tolist() == [True] + [False] * 5
            )
            assert mask[:3, :5].equal(batch.custom_masks[0])
            assert p.batch.custom_masks[3].all()
        finally:
            batches.close()


def test_property_padded_equals_eager(models):  # noqa: F811
    """Random capture lists, batch sizes and algorithms: the replayed forward equals the eager
    one."""
    rng = random.Random(0)
    for algo in ("eagle-tree", "eagle3", "mtp", "standalone"):
        path, kwargs = _engine_kwargs(models, algo)
        with Engine(model_path=path, random_seed=0, max_running_requests=12, **kwargs) as engine:
            target, draft = engine.runner, engine.scheduler.worker.draft
            owners = [
                (
                    g,
                    target,
                    functools.partial(_target_forward, target),
                    target.kv_pool,
                    target.model_config.vocab_size,
                )
                for g in target.graphs
            ]
            owners += [
                (g, draft, draft._forward, draft.kv_pool, draft.model_config.vocab_size)
                for g in draft.graphs
            ]
            for _ in range(6):
                g0, owner, forward, pool, vocab = rng.choice(owners)
                sizes = sorted(rng.sample(range(1, 13), rng.randint(1, 4)))
                g = GraphRunner(g0.spec, sizes, True, g0.dummy_row, g0.device, g0.dtype)
                num = rng.randint(1, sizes[-1])
                batches = SelfCheckBatches(
                    target.req_to_token_pool, target.allocator, [pool], vocab, target.device
                )
                try:
                    with torch.inference_mode():
                        owner.capture(g)
                        batch, feats = batches.make(g, num, g.feature_dim, kv_rows=g.kv_rows)
                        eager = forward(batch, feats)
                        replayed = g.run(batch, feats)
                finally:
                    batches.close()
                assert replayed is not None, (algo, g.label, sizes, num)
                for want, got in zip(eager, replayed):
                    assert torch.allclose(want, got, atol=1e-4), (algo, g.label, sizes, num)


def _target_forward(runner, batch, _features):
    out = runner._forward(batch)
    return out.logits, out.hidden


def test_self_check_refuses_a_padding_bug(llama_path, monkeypatch):
    """Padded rows that write a real slot (the class of bug behind SGLang's draft-padding
    crashes) make startup fail, naming the mode and size."""
    import spec_engine.runner.graph_runner as graph_runner

    monkeypatch.setattr(graph_runner, "DUMMY_SLOT", 1)  # the first slot handed out
    with pytest.raises(RuntimeError, match="target decode at batch size 2"):
        Engine(
            model_path=llama_path,
            random_seed=0,
            max_running_requests=4,
            cuda_graph_bs=[1, 2],
            cuda_graph_self_check=True,
        )


def test_capture_refuses_a_host_sync_in_the_forward(llama_path, monkeypatch):
    """A captured forward that reads a value back to the host (here an .item() in attention) is
    refused at startup on CPU with --cuda-graph-self-check, naming the graph, as CUDA graph
    capture would refuse it."""
    from spec_engine.attention import torch_native
    from spec_engine.runner.graph_capture import CaptureError

    original = torch_native.TorchNativeBackend._forward_padded

    def syncing(self, q, layer, pool, p):
        if int(p.mask.sum().item()) < 0:
            raise AssertionError("unreachable")
        return original(self, q, layer, pool, p)

    monkeypatch.setattr(torch_native.TorchNativeBackend, "_forward_padded", syncing)
    with pytest.raises(CaptureError, match=r"target decode at batch size 1: aten\.item"):
        Engine(
            model_path=llama_path,
            random_seed=0,
            max_running_requests=4,
            cuda_graph_bs=[1, 2],
            cuda_graph_self_check=True,
        )


def test_forward_reading_python_batch_state_fails_the_self_check(llama_path, monkeypatch):
    """Replays run the batch captured at startup, whose Python fields keep their capture-time
    values as in a CUDA graph: attention metadata rebuilt from them inside the graph (instead of
    refilled before the replay) gives wrong outputs, and the self-check refuses to start."""
    from spec_engine.attention import torch_native

    original = torch_native.TorchNativeBackend.forward

    def rebuilding(self, q, k, v, layer, batch):
        batch = dataclasses.replace(batch)
        self.init_forward_metadata(batch)  # reads batch.seq_lens_cpu: frozen at capture
        return original(self, q, k, v, layer, batch)

    monkeypatch.setattr(torch_native.TorchNativeBackend, "forward", rebuilding)
    with pytest.raises(RuntimeError, match="self-check failed: target decode at batch size"):
        Engine(
            model_path=llama_path,
            random_seed=0,
            max_running_requests=4,
            cuda_graph_bs=[1, 2],
            cuda_graph_self_check=True,
        )


def test_replaced_tensors_are_caught_and_resume_recaptures(models, monkeypatch):  # noqa: F811
    """A graph keeps reading the tensors it was captured on: replacing the KV pool behind its back
    is caught at the next replay (with --cuda-graph-self-check); release/resume of memory, weight
    updates and the FR-Spec head refresh keep graphs valid (recapture / in-place updates), with
    outputs equal to eager. Each recapture takes a new memory pool (torch frees a pool whose
    graphs are gone and asserts when a capture names it again)."""
    path, kwargs = spec_args(models, "eagle-frspec")
    pools: list[object] = []
    monkeypatch.setattr(memory, "new_pool", lambda device: pools.append(object()) or pools[-1])
    prompts = random_prompts(4, 6, 14, seed=5)
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    head = "lm_head.weight"
    with Engine(
        model_path=path, random_seed=0, skip_tokenizer_init=True, disable_cuda_graph=True, **kwargs
    ) as eager:
        new_head = eager.runner.model.lm_head.weight.detach() * 1.5
        eager.update_weights_from_tensor([(head, new_head)])
        want = [o["output_ids"] for o in eager.generate(input_ids=prompts, sampling_params=params)]
    with Engine(
        model_path=path,
        random_seed=0,
        skip_tokenizer_init=True,
        cuda_graph_bs=[1, 2, 4],
        cuda_graph_self_check=True,
        **kwargs,
    ) as engine:
        draft = engine.scheduler.worker.draft
        hot_head = draft.head.weight.data_ptr()
        engine.update_weights_from_tensor([(head, new_head)])
        # CPU matmuls read a oneDNN-packed copy the input check cannot see: check the head directly.
        assert draft.head.weight.data_ptr() == hot_head
        for tags in (["kv_cache"], ["weights"], None):
            engine.release_memory_occupation(tags)
            engine.resume_memory_occupation(tags)
            graphs = [g for r in engine.memory.runners for g in r.graphs]
            assert len(graphs) >= 2 and all(g.pool is pools[-1] for g in graphs)
        assert len(pools) == 3
        assert [
            o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)
        ] == want
        engine.runner.kv_pool.allocate()  # new buffers without recapturing
        with pytest.raises(
            RuntimeError,
            match=r"CaptureError.*target target_verify at batch size \d: the captured "
            "forward now reads",
        ):
            engine.generate(input_ids=prompts, sampling_params=params)


def test_padded_masks_equal_each_requests_mask_laid_out_alone():
    """The graph runner's padded extend masks, built by a fixed number of kernels, against each
    request's mask padded on its own: the real (or causal) block, key 0 alone for padded queries,
    every key for padded requests; on the meta device (standing in for CUDA) nothing is built on
    another device."""
    cpu = torch.device("cpu")
    gen = torch.Generator(device=cpu).manual_seed(0)

    def alone(q: int, p: int, width: int, real) -> torch.Tensor:
        mask = torch.zeros(width, p + width, dtype=torch.bool, device=cpu)
        mask[:q, : p + q] = real if real is not None else causal_mask(p, p + q, cpu)
        mask[q:, 0] = True
        return mask

    for trial in range(200):
        width, b = random.Random(trial).randint(1, 5), random.Random(-trial).randint(1, 4)
        size = b + trial % 3
        q_lens = torch.randint(1, width + 1, (b,), generator=gen, device=cpu).tolist()
        prefixes = torch.randint(0, 7, (b,), generator=gen, device=cpu).tolist()
        real = None
        if trial % 2:
            real = [
                torch.rand(q, p + q, generator=gen, device=cpu) < 0.5
                for q, p in zip(q_lens, prefixes)
            ]
        got = padded_masks(q_lens, prefixes, width, size, real, cpu)
        want = [
            alone(q, p, width, None if real is None else real[i])
            for i, (q, p) in enumerate(zip(q_lens, prefixes))
        ] + [torch.ones(width, width, dtype=torch.bool, device=cpu)] * (size - b)
        assert len(got) == size and all(g.equal(w) for g, w in zip(got, want)), trial
    meta = padded_masks([2, 3], [1, 4], 3, 3, None, torch.device("meta"))
    assert [m.shape for m in meta] == [(3, 4), (3, 7), (3, 3)] and meta[0].device.type == "meta"
