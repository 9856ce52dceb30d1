"""Speculative decoding is lossless, batched, and keeps exact KV and log-prob bookkeeping."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from spec_engine import Engine
from tests.conftest import random_prompts
from tests.engine.test_sampling import chi2_pvalue, expected_probs
from tiny.checkpoints import add_mimo_mtp, build_checkpoint, build_eagle_draft

GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(make_model, tmp_path_factory):
    """A 4-layer Llama target with EAGLE-2/EAGLE-3/small-LM drafts, and a MiMo (MTP) target."""
    target = make_model("llama", num_layers=4)
    root = tmp_path_factory.mktemp("drafts")
    token_map = str(root / "hot.pt")
    torch.save(torch.arange(5, 300), token_map)
    return {
        "target": target,
        "eagle": build_eagle_draft(str(root / "eagle"), target, version=2),
        "eagle3": build_eagle_draft(str(root / "eagle3"), target, version=3, draft_vocab_size=128),
        "eagle3_full": build_eagle_draft(
            str(root / "eagle3_full"), target, version=3, aux_layer_ids=[0, 1, 2]
        ),
        "small": build_checkpoint(str(root / "small"), arch="llama", num_layers=1, seed=5),
        "mimo": add_mimo_mtp(make_model("qwen2", num_layers=2, seed=7)),
        "token_map": token_map,
    }


CONFIGS = {
    "eagle-chain": (
        "target",
        dict(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path="eagle",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
        ),
    ),
    "eagle-tree": (
        "target",
        dict(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path="eagle",
            speculative_num_steps=3,
            speculative_eagle_topk=3,
            speculative_num_draft_tokens=6,
        ),
    ),
    "eagle-frspec": (
        "target",
        dict(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path="eagle",
            speculative_num_steps=2,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=4,
            speculative_token_map="token_map",
        ),
    ),
    "eagle3-draft-vocab": (
        "target",
        dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path="eagle3",
            speculative_num_steps=3,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=5,
        ),
    ),
    "eagle3-aux-ids": (
        "target",
        dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path="eagle3_full",
            speculative_num_steps=2,
            speculative_eagle_topk=1,
        ),
    ),
    "mtp": (
        "mimo",
        dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1),
    ),
    "standalone": (
        "target",
        dict(
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path="small",
            speculative_num_steps=3,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=5,
        ),
    ),
    "standalone-self-tree": (
        "target",
        dict(
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path="target",
            speculative_num_steps=3,
            speculative_eagle_topk=3,
            speculative_num_draft_tokens=7,
        ),
    ),
    "ngram": ("target", dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)),
    "eagle-tree-paged": (
        "target",
        dict(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path="eagle",
            speculative_num_steps=3,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=5,
            page_size=4,
        ),
    ),
}


def spec_args(models, name):
    target_key, kwargs = CONFIGS[name]
    resolved = {
        k: (models[v] if k in ("speculative_draft_model_path", "speculative_token_map") else v)
        for k, v in kwargs.items()
    }
    return models[target_key], resolved


_BASELINES: dict = {}


def baseline(path, prompts, params):
    key = (path, str(prompts), str(params))
    if key not in _BASELINES:
        with Engine(model_path=path, random_seed=0) as engine:
            _BASELINES[key] = engine.generate(
                input_ids=prompts, sampling_params=params, return_logprob=True
            )
    return _BASELINES[key]


def assert_clean(engine):
    report = engine.scheduler.memory_report()
    assert report["free"] + report["cached"] == report["total"]
    assert engine.flush_cache()
    assert engine.scheduler.memory_report()["free"] == report["total"]


def assert_same(outs, ref):
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
    diffs = [
        abs(a[0] - b[0])
        for o, r in zip(outs, ref)
        for a, b in zip(
            o["meta_info"]["output_token_logprobs"], r["meta_info"]["output_token_logprobs"]
        )
    ]
    assert max(diffs) < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_and_logprobs_equal_plain_decoding(models, name):
    path, kwargs = spec_args(models, name)
    prompts = random_prompts(8, 1, 50, seed=20)
    # Continuations of earlier prompts and outputs, served from the prefix cache.
    stops = {"stop_token_ids": [5, 6, 7, 8, 9, 10], "min_new_tokens": 10, "ignore_eos": False}
    params = [GREEDY] * 8 + [{**GREEDY, **stops}] * 2
    with Engine(model_path=path, random_seed=0, **kwargs) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        a, b = sorted(range(8), key=lambda i: -len(prompts[i]))[
            :2
        ]  # long enough to span cached pages
        more = [prompts[a] + [7, 8, 9], prompts[b] + outs[b]["output_ids"][:10]]
        later = engine.generate(
            input_ids=prompts + more, sampling_params=params, return_logprob=True
        )
        info = engine.get_server_info()["internal_states"][0]
        assert_clean(engine)
    assert_same(outs, baseline(path, prompts, GREEDY))
    assert_same(later, baseline(path, prompts + more, params))
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in later[8:])
    for out in outs:
        meta = out["meta_info"]
        # The first token comes from prefill, every other one from a verify pass.
        assert meta["spec_accept_length"] == pytest.approx(
            (meta["completion_tokens"] - 1) / meta["spec_verify_ct"]
        )
    assert info["avg_spec_accept_length"] == pytest.approx(
        sum(o["meta_info"]["completion_tokens"] - 1 for o in outs + later) / info["spec_verify_ct"]
    )
    assert set(info["spec_time_breakdown"]) == {"draft_s", "verify_s", "bookkeeping_s"}


@pytest.mark.parametrize("name", ["eagle-tree", "ngram", "mtp"])
def test_joining_mid_run_and_n_samples_are_lossless(models, name):
    path, kwargs = spec_args(models, name)
    first, later = random_prompts(3, 5, 30, seed=21), random_prompts(3, 5, 30, seed=22)
    params = {**GREEDY, "max_new_tokens": 40}
    results = {}
    with Engine(model_path=path, random_seed=0, **kwargs) as engine:
        t = threading.Thread(
            target=lambda: results.setdefault(
                "first",
                engine.generate(input_ids=first, sampling_params=params, return_logprob=True),
            )
        )
        t.start()
        deadline = time.time() + 60
        while not engine.scheduler.running and time.time() < deadline:
            time.sleep(0.001)
        results["later"] = engine.generate(
            input_ids=later, sampling_params=params, return_logprob=True
        )
        t.join()
        many = engine.generate(
            input_ids=random_prompts(1, 40, 40, seed=25)[0], sampling_params={**params, "n": 4}
        )
        assert_clean(engine)
    assert_same(results["first"], baseline(path, first, params))
    assert_same(results["later"], baseline(path, later, params))
    assert len({tuple(o["output_ids"]) for o in many}) == 1
    # The samples share the prompt's KV (all but the first find it cached).
    assert sorted(o["meta_info"]["cached_tokens"] > 0 for o in many) == [False, True, True, True]


def test_target_as_its_own_draft_accepts_every_token(models):
    path = models["target"]
    steps = 3
    params = {**GREEDY, "max_new_tokens": 1 + 5 * (steps + 1)}
    with Engine(
        model_path=path,
        random_seed=0,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=path,
        speculative_num_steps=steps,
        speculative_eagle_topk=1,
    ) as engine:
        outs = engine.generate(input_ids=random_prompts(4, 3, 20, seed=23), sampling_params=params)
        info = engine.get_server_info()["internal_states"][0]
    for out in outs:
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] == 5
        assert meta["spec_accept_length"] == steps + 1
        assert meta["spec_accept_rate"] == 1.0
    assert info["avg_spec_accept_length"] == steps + 1


def test_self_draft_shares_the_targets_model_and_kv_cache(models):
    """The target as its own STANDALONE draft holds no second copy of its weights or KV cache,
    and stays lossless through release/resume and a weight update (which reaches it as the
    target's: it has no `draft.*` weights of its own)."""
    path = models["target"]
    prompts = random_prompts(3, 4, 12, seed=29)
    spec = dict(
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=path,
        speculative_num_steps=2,
        speculative_eagle_topk=1,
    )
    with Engine(model_path=path, random_seed=0, **spec) as engine:
        draft = engine.scheduler.worker.draft
        assert draft.model is engine.runner.model and draft.kv_pool is engine.runner.kv_pool
        assert not any(n.startswith("draft.") for n in engine.get_weights_checksum())
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
        head = engine.runner.model.lm_head.weight.detach().clone()
        engine.update_weights_from_tensor([("lm_head.weight", head)])
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        assert all(o["meta_info"]["spec_accept_length"] > 2.5 for o in outs)
    assert_same(outs, baseline(path, prompts, GREEDY))


def test_ngram_accepts_several_tokens_on_repetitive_text(models):
    prompt = [11, 12, 13, 14, 15, 16, 17, 18] * 6
    with Engine(
        model_path=models["target"],
        random_seed=0,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=8,
    ) as engine:
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["meta_info"]["spec_accept_length"] > 1.0


def test_retraction_chunked_prefill_and_speculation(models):
    path, kwargs = spec_args(models, "eagle-tree")
    prompts = random_prompts(10, 20, 60, seed=24)
    params = {**GREEDY, "max_new_tokens": 30}
    with Engine(
        model_path=path, random_seed=0, max_total_tokens=400, chunked_prefill_size=32, **kwargs
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert engine.scheduler.retraction.num_retractions > 0
        assert_clean(engine)
    assert_same(outs, baseline(path, prompts, params))


def test_a_lone_request_at_the_kv_limit_completes(models):
    path, kwargs = spec_args(models, "eagle-tree")
    with Engine(model_path=path, random_seed=0, max_total_tokens=96, **kwargs) as engine:
        headroom = engine.scheduler.worker.decode_headroom()
        budget = 96 - headroom
        out = engine.generate(
            input_ids=[5] * 20, sampling_params={**GREEDY, "max_new_tokens": budget - 20}
        )
        assert out["meta_info"]["completion_tokens"] == budget - 20
        with pytest.raises(ValueError, match="speculative drafts"):
            engine.generate(
                input_ids=[5] * 20, sampling_params={**GREEDY, "max_new_tokens": budget - 19}
            )
        unset = engine.generate(
            input_ids=[5] * 20, sampling_params={**GREEDY, "max_new_tokens": None}
        )
        assert unset["meta_info"]["completion_tokens"] == budget - 20
        assert_clean(engine)


# ---------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab8")
    target = build_checkpoint(
        str(root / "target"),
        arch="llama",
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
    )
    draft = build_eagle_draft(str(root / "eagle"), target, version=2, std=0.3)
    return target, draft


FILTERS = {
    "top-p": {"temperature": 0.9, "top_p": 0.95},
    "top-k-min-p": {"temperature": 1.0, "top_k": 5, "min_p": 0.05},
}
PROMPT = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]


def joint_of_tokens_2_and_3(hf, path, params) -> torch.Tensor:
    """Exact P(t2, t3) (summed over t1) of the target under `params`, as transformers computes
    it."""
    p1 = expected_probs(hf.next_token_logits(path, PROMPT), **params)
    joint = torch.zeros(8, 8, dtype=torch.float64)
    for t1 in range(8):
        p2 = expected_probs(hf.next_token_logits(path, PROMPT + [t1]), **params)
        for t2 in range(8):
            if p1[t1] * p2[t2] > 0:
                p3 = expected_probs(hf.next_token_logits(path, PROMPT + [t1, t2]), **params)
                joint[t2] += (p1[t1] * p2[t2] * p3).double()
    return joint


def sample_counts(path, params, samples=1500, **kwargs) -> tuple[torch.Tensor, float]:
    """Counts of (t2, t3) over `samples` draws, and the acceptance length. 1500 draws: the lossy
    acceptance's p-values are below 1e-24 (1e-68 and less at 4000), and an EAGLE tree whose
    residual keeps its tried children, or whose acceptance and residual share a uniform, gives
    p below 1e-14 too (measured on this test's models and seed)."""
    with Engine(model_path=path, random_seed=0, skip_tokenizer_init=True, **kwargs) as engine:
        outs = engine.generate(
            input_ids=PROMPT,
            sampling_params={**params, "max_new_tokens": 3, "ignore_eos": True, "n": samples},
        )
        accept = engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"]
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for o in outs:
        counts[o["output_ids"][1], o["output_ids"][2]] += 1
    return counts, accept


def pvalues(counts: torch.Tensor, joint: torch.Tensor) -> tuple[float, float]:
    """(one-token test on t2, two-token test on (t2, t3)), rare cells merged so each expects >=
    5."""
    one = chi2_pvalue(counts.sum(1), joint.sum(1))
    flat_c, flat_p = counts.flatten(), joint.flatten()
    rare = flat_p * counts.sum() < 5
    merged_c = torch.cat((flat_c[~rare], flat_c[rare].sum()[None]))
    merged_p = torch.cat((flat_p[~rare], flat_p[rare].sum()[None]))
    return one, chi2_pvalue(merged_c, merged_p)


@pytest.mark.parametrize(
    "algo,filters", [("EAGLE", "top-p"), ("EAGLE", "top-k-min-p"), ("NGRAM", "top-p")]
)
def test_sampling_follows_the_target_distribution_and_lossy_acceptance_is_caught(
    small_vocab, hf, algo, filters
):
    target, draft = small_vocab
    if algo == "EAGLE":
        kwargs = dict(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=draft,
            speculative_num_steps=2,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=4,
        )
    else:
        kwargs = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    params = FILTERS[filters]
    joint = joint_of_tokens_2_and_3(hf, target, params)
    counts, accept = sample_counts(target, params, **kwargs)
    assert accept > 1.2, "drafts must be accepted for this test to exercise verification"
    one, two = pvalues(counts, joint)
    assert one > 1e-3 and two > 1e-3
    lossy, _ = sample_counts(target, params, speculative_accept_threshold_acc=0.5, **kwargs)
    one, two = pvalues(lossy, joint)
    assert min(one, two) < 1e-6


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (
            dict(
                speculative_algorithm="EAGLE",
                speculative_draft_model_path="eagle",
                speculative_num_steps=2,
                speculative_eagle_topk=2,
                speculative_num_draft_tokens=9,
            ),
            "--speculative-num-draft-tokens",
        ),
        (dict(speculative_algorithm="EAGLE"), "--speculative-draft-model-path"),
        (
            dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="eagle"),
            "LlamaForCausalLMEagle3",
        ),
        (
            dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="eagle"),
            "plain LM",
        ),
        (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="eagle"), "NGRAM"),
        (dict(speculative_algorithm="NGRAM", speculative_num_steps=3), "NGRAM"),
        (
            dict(
                speculative_algorithm="EAGLE3",
                speculative_draft_model_path="eagle3",
                speculative_token_map="token_map",
            ),
            "FR-Spec",
        ),
        (dict(speculative_num_steps=3), "--speculative-algorithm"),
        (dict(speculative_algorithm="MEDUSA"), "--speculative-algorithm"),
        (
            dict(speculative_algorithm="NGRAM", speculative_ngram_max_match_window_size=20),
            "branch-length",
        ),
        (
            dict(
                speculative_algorithm="EAGLE",
                speculative_draft_model_path="eagle",
                speculative_accept_threshold_acc=0.0,
            ),
            "threshold",
        ),
    ],
)
def test_invalid_speculative_settings_are_refused(models, kwargs, needle):
    resolved = {
        k: (models[v] if k in ("speculative_draft_model_path", "speculative_token_map") else v)
        for k, v in kwargs.items()
    }
    with pytest.raises(ValueError, match=needle):
        Engine(model_path=models["target"], **resolved)


def test_draft_that_does_not_fit_the_target_is_refused(models, make_model, tmp_path):
    other = make_model("llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="hidden size"):
        Engine(
            model_path=other,
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=models["eagle"],
        )
    short = build_checkpoint(
        str(tmp_path / "short"), arch="llama", num_layers=1, max_position_embeddings=64
    )
    # A shorter draft context is raised to the target's (SGLang PR 9388), not refused.
    with Engine(
        model_path=models["target"],
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=short,
        skip_tokenizer_init=True,
    ) as engine:
        assert engine.config.draft.rope_max_positions > 64
    small_vocab = build_checkpoint(
        str(tmp_path / "vocab"), arch="llama", num_layers=1, vocab_size=256
    )
    with pytest.raises(ValueError, match="vocab_size is 256 .* needs the same tokenizer"):
        Engine(
            model_path=models["target"],
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=small_vocab,
        )
    with pytest.raises(ValueError, match="draft"):
        Engine(model_path=models["eagle"])
    assert os.path.isdir(models["eagle"])


def test_default_tree_shapes_follow_sglang(models):
    with Engine(
        model_path=models["target"],
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=models["eagle"],
    ) as engine:
        a = engine.args
        assert (
            a.speculative_num_steps,
            a.speculative_eagle_topk,
            a.speculative_num_draft_tokens,
        ) == (5, 4, 8)
    with Engine(model_path=models["mimo"], speculative_algorithm="EAGLE") as engine:
        a = engine.args
        assert (
            a.speculative_num_steps,
            a.speculative_eagle_topk,
            a.speculative_num_draft_tokens,
        ) == (3, 1, 4)
    with Engine(model_path=models["target"], speculative_algorithm="NGRAM") as engine:
        assert engine.args.speculative_num_draft_tokens == 12
