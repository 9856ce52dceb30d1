"""Tensor parallelism at --tp-size 2 on the CPU (two gloo ranks, rank 1 spawned by the engine):
plain decoding equals tp 1 (greedy tokens, log-probs within 1e-4 in float32) for each dense
family, with KV heads split and replicated and a vocabulary that does not divide; each rank reads
only its shard; --debug-tp-check-tokens catches ranks that disagree; what tp > 1 does not run is
refused before any rank starts; a rank that dies fails the requests in flight within seconds, and
one that fails to start is named."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from spec_engine import Engine
from spec_engine.distributed.launch import RankFailed, Ranks
from spec_engine.distributed.token_check import TokenCheck, TokenMismatch
from spec_engine.engine_loop import HEARTBEAT_S
from spec_engine.weights.loader import checkpoint_files
from spec_engine.weights.transport import serialize_shared
from tests.conftest import FAMILIES
from tests.support.safetensors_reads import record_reads
from tests.support.tp_ranks import Sampled, fail_on_rank_1, sample_9_for_request_b
from tiny.checkpoints import add_mimo_mtp


@pytest.fixture(scope="module", autouse=True)
def forked_ranks() -> Iterator[None]:
    """Rank 1 of each engine forked from tests/support/forkserver.py's server (torch and the
    engine imported) instead of spawned: a process of its own still, without seconds of imports."""
    from spec_engine.distributed import launch
    from tests.support.forkserver import instead_of_spawn

    with instead_of_spawn(launch):
        yield


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
ENGINE = dict(skip_tokenizer_init=True, max_total_tokens=512, device="cpu", log_level="warning")
# Each model covers what its family adds: llama an untied head, a vocabulary of 511 (the last
# rank's block padded) and one KV head (replicated on both ranks); qwen2 q/k/v biases and a tied
# head with its two KV heads split; qwen3 q/k norms and head_dim != hidden / heads; mimo is
# qwen2's trunk with an MTP layer in the checkpoint (skipped without speculation).
MODELS = {
    "llama": dict(FAMILIES["llama"], vocab_size=511, num_kv_heads=1),
    "qwen2": dict(FAMILIES["qwen2"]),
    "qwen3": dict(FAMILIES["qwen3"]),
    "mimo": dict(FAMILIES["qwen2"], seed=7),
}


def _path(family: str, make_model) -> str:
    path = make_model(**MODELS[family])
    if family == "mimo" and not os.path.exists(os.path.join(path, "mimo")):
        add_mimo_mtp(path)
        open(os.path.join(path, "mimo"), "w").close()
    return path


def _generate(path: str, tp_size: int, **kwargs) -> list[dict]:
    with Engine(model_path=path, tp_size=tp_size, **ENGINE, **kwargs) as engine:
        info = engine.get_server_info()
        assert info["tp_size"] == tp_size
        return engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)


# qwen2 alone would add a spawn's seconds and nothing mimo does not cover.
@pytest.mark.parametrize("family", ["llama", "mimo", "qwen3"])
def test_tp2_decodes_as_tp1(family, make_model, hf):
    path = _path(family, make_model)
    one = _generate(path, 1)
    two = _generate(path, 2, debug_tp_check_tokens=True)
    for a, b in zip(one, two):
        assert b["output_ids"] == a["output_ids"]
        la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4
    if family == "mimo":
        return  # transformers has no MiMo; its trunk is qwen2's, checked above
    tokens, logprobs = hf.greedy(path, PROMPTS[0], GREEDY["max_new_tokens"])
    assert two[0]["output_ids"] == tokens
    lb = [lp for lp, _, _ in two[0]["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(lb, logprobs)) < 1e-4


def test_reports_between_overlapped_steps_keep_the_ranks_in_lockstep(make_model):
    """A report (a closure, run on rank 0 alone) drains rank 0's decode step in flight; rank 1
    drains with it (engine_loop.DRAIN), so the ranks stay in lockstep and tp 2 decodes as tp 1."""
    path = _path("llama", make_model)
    one = _generate(path, 1)
    with Engine(model_path=path, tp_size=2, **ENGINE) as engine:
        step, steps, reports = engine.scheduler.step, [0], []

        def stepped() -> None:
            step()
            steps[0] += 1
            if steps[0] in (3, 5):  # a decode step is in flight: posted, run before the next
                reports.append(engine._post(engine.scheduler.memory_report))

        engine.scheduler.step = stepped
        two: list = []
        run = threading.Thread(
            target=lambda: two.extend(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)),
            daemon=True,
        )
        run.start()
        run.join(timeout=60)
        if run.is_alive():  # ranks out of lockstep wait on each other: end rank 1 to stop
            engine._ranks.procs[0].kill()
            pytest.fail("tp 2 generation hung: the ranks fell out of lockstep")
        assert engine.scheduler.overlap
    assert [o["output_ids"] for o in two] == [o["output_ids"] for o in one]
    assert all(r.result(timeout=5)["owned_by_requests"] > 0 for r in reports)


def test_each_rank_reads_only_its_shard(make_model, monkeypatch):
    """The split weights come off disk as safetensors slices, one block per rank."""
    from spec_engine.distributed.parallel_state import TPGroup, use_tp_group
    from spec_engine.models.hf_config import ModelConfig
    from spec_engine.models.registry import model_class
    from spec_engine.weights.loader import build_model

    path = make_model(**MODELS["qwen2"])
    whole, sliced = record_reads(monkeypatch)
    config = ModelConfig.from_pretrained(path)
    with use_tp_group(TPGroup(rank=1, size=2)):
        model = build_model(model_class(config), config, torch.float32, torch.device("cpu"), path)
    split = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {n for n in whole if n.split(".")[-2] in split | {"embed_tokens"}} == set()
    with safe_open(checkpoint_files(path)[0], framework="pt") as f:
        up = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        o = f.get_tensor("model.layers.1.self_attn.o_proj.weight")
        embed = f.get_tensor("model.embed_tokens.weight")
    inter = up.shape[0] // 2
    params = dict(model.named_parameters())
    assert torch.equal(params["model.layers.0.mlp.gate_up_proj.weight"][inter:], up[inter:])
    assert torch.equal(params["model.layers.1.self_attn.o_proj.weight"], o[:, o.shape[1] // 2 :])
    assert torch.equal(params["model.embed_tokens.weight"], embed[embed.shape[0] // 2 :])


def test_debug_tp_check_tokens_fails_a_step_where_ranks_disagree():
    """Rank 1 (spawned) samples another token for request "b" than rank 0, in a decode step
    and in an overlapped one (checked when read back): both ranks' checks raise, naming the
    request, the tokens and the rank."""
    reqs = [SimpleNamespace(input=SimpleNamespace(rid=rid)) for rid in "ab"]
    ranks = Ranks(sample_9_for_request_b, reqs, 2, torch.device("cpu"))
    try:
        group = ranks.connect()
        ranks.wait_ready()
        check = TokenCheck(Sampled([7, 8]), group)
        for step in (lambda: check.decode(reqs), lambda: check.launch_decode(reqs).finish()):
            with pytest.raises(TokenMismatch, match="request 'b' got 8 on rank 0 and 9 on rank 1"):
                step()
    finally:
        ranks.stop(timeout_s=30)
    assert ranks.procs[0].exitcode == 0  # rank 1's check raised as well


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp_size=3), r"num_attention_heads \(4\) is not divisible by --tp-size 3"),
        (dict(dist_init_addr="localhost"), "--dist-init-addr must be HOST:PORT, got 'localhost'"),
        (dict(ep_size=2), "--ep-size 2: LlamaForCausalLM has no MoE layers; drop --ep-size"),
        (dict(ep_size=3), r"--ep-size 3 with --tp-size 2: .* one of \[1, 2\]"),
        (dict(quantization="fp8"), "--tp-size 2: FP8 weight .* not divisible by .* 128"),
    ],
)
def test_what_tp_does_not_run_is_refused_before_any_rank_starts(kwargs, match, llama_path):
    args = dict(ENGINE, tp_size=2) | kwargs
    with pytest.raises(ValueError, match=match):
        Engine(model_path=llama_path, **args)


def test_cuda_ranks_need_their_gpus_and_eager_forwards(llama_path, monkeypatch):
    """On CUDA (the check alone, with the machine's GPU count faked): rank r needs GPU
    --base-gpu-id + r, and graphs are refused at tp > 1."""
    from spec_engine.args.tp_checks import check_tensor_parallel
    from spec_engine.models.hf_config import ModelConfig

    target = ModelConfig.from_pretrained(llama_path)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = dict(
        device="cuda", tp_size=2, nnodes=1, ep_size=1, base_gpu_id=0, speculative_algorithm=None
    )
    with pytest.raises(ValueError, match="CUDA graphs .* add --disable-cuda-graph"):
        check_tensor_parallel(SimpleNamespace(**cuda, disable_cuda_graph=False), target)
    check_tensor_parallel(SimpleNamespace(**cuda, disable_cuda_graph=True), target)
    # --nnodes 2: each node's two ranks on its own GPUs 0..1
    check_tensor_parallel(
        SimpleNamespace(**dict(cuda, tp_size=4, nnodes=2), disable_cuda_graph=True), target
    )
    late = SimpleNamespace(**dict(cuda, base_gpu_id=1), disable_cuda_graph=True)
    with pytest.raises(ValueError, match="base-gpu-id 1 needs GPUs 1..2, and this machine has 2"):
        check_tensor_parallel(late, target)


@pytest.mark.parametrize("name", ["SGLANG_REQ_WAITING_TIMEOUT", "SGLANG_QUEUED_TIMEOUT_MS"])
def test_request_timeouts_are_refused_at_tp2(name, llama_path, monkeypatch):
    """Each rank would decide a timeout on its own clock, and the ranks must agree."""
    monkeypatch.setenv(name, "5")
    with pytest.raises(ValueError, match=f"--tp-size 2: {name} set: .* unset them"):
        Engine(model_path=llama_path, tp_size=2, **ENGINE)


def test_a_rank_that_fails_to_start_is_named():
    ranks = Ranks(fail_on_rank_1, "payload", 2, torch.device("cpu"))
    try:
        ranks.connect()
        with pytest.raises(RankFailed, match="rank 1 failed to start:(.|\n)*rank 1 cannot build"):
            ranks.wait_ready()
    finally:
        ranks.stop(timeout_s=5)


def test_disk_updates_reach_every_rank_and_a_bad_one_changes_none(make_model, tmp_path):
    """update_weights_from_disk at tp 2: every rank loads its blocks and decodes as tp 1 on the
    new weights; a checkpoint whose only NaN lies in rank 1's block (a column of a row-parallel
    down_proj) is refused on both ranks, naming rank 1, and rank 0 keeps its old weights too.
    update_weights_from_tensor brings the old weights back on every rank, and SGLang's
    serialized_named_tensors (one entry per rank) the new ones."""
    from safetensors.torch import load_file, save_file

    old, new = make_model(**MODELS["qwen2"]), make_model(**dict(MODELS["qwen2"], seed=3))
    bad = tmp_path / "bad"
    shutil.copytree(new, bad)
    weights = load_file(bad / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][:, -1] = float("nan")
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    with Engine(model_path=old, tp_size=2, **ENGINE) as engine:
        before = [
            o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        ]
        with pytest.raises(ValueError, match="non-finite.*tensor-parallel rank 1; no rank updated"):
            engine.update_weights_from_disk(str(bad))
        kept = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in kept] == before
        assert engine.update_weights_from_disk(new, weight_version="v2")["success"]
        after = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        # From tensors (rank 0 sends the whole tensors, each rank takes its blocks): back to old.
        engine.update_weights_from_tensor(list(load_file(f"{old}/model.safetensors").items()))
        back = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in back] == before
        # SGLang's serialized form, one entry per rank (shared memory here), to new again.
        shared = list(load_file(f"{new}/model.safetensors").items())
        entries = [serialize_shared(shared) for _ in range(2)]
        with pytest.raises(ValueError, match="one entry per tensor-parallel rank .* has 2; got 1"):
            engine.update_weights_from_tensor(serialized_named_tensors=entries[:1])
        engine.update_weights_from_tensor(serialized_named_tensors=entries)
        again = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in after]
    expected = _generate(new, 1)
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in expected]
    assert after[0]["meta_info"]["weight_version"] == "v2"
    lb = [lp for lp, _, _ in after[0]["meta_info"]["output_token_logprobs"]]
    la = [lp for lp, _, _ in expected[0]["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4
    assert before != [o["output_ids"] for o in after]


def test_a_dead_rank_fails_requests_in_flight_within_seconds(make_model):
    path = make_model(**MODELS["qwen2"])
    engine = Engine(model_path=path, tp_size=2, **dict(ENGINE, max_total_tokens=2048))
    try:
        done: dict[str, object] = {}
        started = threading.Event()

        def generate() -> None:
            params = {"temperature": 0.0, "max_new_tokens": 500, "ignore_eos": True}
            try:
                for _ in engine.generate(input_ids=[5, 6, 7], sampling_params=params, stream=True):
                    started.set()
            except Exception as e:
                done["error"] = str(e)
            done["at"] = time.monotonic()

        thread = threading.Thread(target=generate)
        thread.start()
        assert started.wait(30)
        killed = time.monotonic()
        engine._ranks.procs[0].kill()
        thread.join(30)
        assert done["at"] - killed < 5
        assert "tensor-parallel rank 1 (pid" in done["error"]
        assert "exited with code -9" in done["error"]
        with pytest.raises(RuntimeError, match="engine is shut down: tensor-parallel rank 1"):
            engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
    finally:
        engine.shutdown()


def test_a_rank_that_dies_while_the_engine_is_idle_is_noticed(make_model):
    """Rank 0's idle heartbeat (an empty broadcast every HEARTBEAT_S) finds the dead rank
    before any request comes: the next call is refused, naming it."""
    engine = Engine(model_path=make_model(**MODELS["qwen2"]), tp_size=2, **ENGINE)
    try:
        engine._ranks.procs[0].kill()
        time.sleep(HEARTBEAT_S + 1.5)
        with pytest.raises(RuntimeError, match="engine is shut down: tensor-parallel rank 1 .pid"):
            engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
    finally:
        engine.shutdown()
