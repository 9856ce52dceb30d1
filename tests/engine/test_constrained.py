"""Constrained decoding with SGLang's names (regex, json_schema, ebnf): outputs always parse
(re.fullmatch, json.loads and jsonschema), the reported log-probs are those of the constrained
distribution (transformers' logits over the tokens the grammar allows, found from the
tokenizer's vocabulary), bad grammars fail with SGLang's messages, and every speculative
algorithm gives the plain constrained greedy output token for token (draft tokens that break the
grammar are rejected at verify)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from spec_engine import Engine, EngineArgs
from tests.conftest import random_prompts
from tiny.checkpoints import add_mimo_mtp, build_eagle_draft

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        # A pattern: xgrammar's strings otherwise allow raw control characters (json.loads not).
        "name": {"type": "string", "pattern": "^[a-z ]{1,5}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
EBNF = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= "a" | "bc" | [0-9]'
EBNF_RE = r"\((a|bc|[0-9])(,(a|bc|[0-9])){0,2}\)"
CONSTRAINTS = [{"regex": REGEX}, {"json_schema": json.dumps(SCHEMA)}, {"ebnf": EBNF}]


def assert_parses(out: dict, constraint: dict) -> None:
    """A finished constrained output matches its grammar (the grammar ended it: stop)."""
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    text = out["text"]
    if "regex" in constraint:
        assert re.fullmatch(REGEX, text), text
    elif "ebnf" in constraint:
        assert re.fullmatch(EBNF_RE, text), text
    else:
        value = json.loads(text)
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(value, SCHEMA)


@pytest.fixture(scope="module")
def target(make_model) -> str:
    return make_model("llama", num_layers=4)


def test_outputs_parse_and_logprobs_are_the_constrained_distribution(target, hf):
    prompts = random_prompts(2, 2, 12, seed=3)
    # Compact JSON (SGLang's flag): a random model's JSON would otherwise wander in whitespace.
    with Engine(
        model_path=target, random_seed=0, constrained_json_disable_any_whitespace=True
    ) as engine:
        for constraint in CONSTRAINTS:
            for temperature in (0.0, 1.0):
                n = 1 if temperature == 0.0 else 3
                params = {"temperature": temperature, "max_new_tokens": 40, "n": n, **constraint}
                outs = engine.generate(
                    input_ids=prompts, sampling_params=params, return_logprob=True
                )
                for out in outs:
                    assert_parses(out, constraint)
        yes_no = engine.generate(
            input_ids=prompts[0],
            sampling_params={"temperature": 0.0, "ebnf": 'root ::= "yes" | "no"'},
            return_logprob=True,
        )
        first_json = engine.generate(
            input_ids=prompts[0],
            sampling_params={"temperature": 1.0, "json_schema": json.dumps(SCHEMA)},
            return_logprob=True,
        )
        tokenizer = engine.tokenizer
    assert yes_no["text"] in ("yes", "no")
    # The first token may be any vocabulary entry that starts "yes" or "no": its log-prob is
    # the model's over those tokens alone (SGLang reports the masked distribution's).
    logits = hf.next_token_logits(target, prompts[0])
    vocab = [tokenizer.decode([t]) for t in range(logits.shape[0])]
    allowed = [t for t, s in enumerate(vocab) if s and ("yes".startswith(s) or "no".startswith(s))]
    expected = torch.log_softmax(logits[allowed], -1)
    lp, token, _ = yes_no["meta_info"]["output_token_logprobs"][0]
    assert token == allowed[int(expected.argmax())]
    assert lp == pytest.approx(float(expected.max()), abs=1e-4)
    # Compact JSON starts with "{" and nothing else: probability 1.
    assert first_json["meta_info"]["output_token_logprobs"][0][0] == pytest.approx(0.0, abs=1e-6)


def test_bad_grammars_fail_as_in_sglang(target):
    with Engine(model_path=target, random_seed=0) as engine:
        for field, value, kind in (
            ("regex", "([a", "regex"),
            ("json_schema", "{bad", "json"),
            ("ebnf", "root ::= ", "ebnf"),
        ):
            with pytest.raises(ValueError) as e:
                engine.generate(input_ids=[5, 6], sampling_params={field: value})
            assert str(e.value) == f"Invalid grammar request: req.grammar_key={(kind, value)!r}"
        with pytest.raises(ValueError, match="Only one of regex, json_schema, or ebnf can be set"):
            engine.generate(input_ids=[5, 6], sampling_params={"regex": "a", "ebnf": EBNF})
        with pytest.raises(ValueError, match="structural tags are not supported"):
            engine.generate(input_ids=[5, 6], sampling_params={"structural_tag": "{}"})
        # The engine still serves after the refusals; the grammar ends the output even when
        # EOS is ignored (SGLang: the matcher terminated).
        out = engine.generate(
            input_ids=[5, 6], sampling_params={"regex": "(yes|no)", "ignore_eos": True}
        )
        assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"
    with Engine(model_path=target, grammar_backend="none") as engine:
        with pytest.raises(ValueError, match="--grammar-backend none"):
            engine.generate(input_ids=[5, 6], sampling_params={"regex": "a+"})
    with pytest.raises(ValueError, match="use --grammar-backend xgrammar"):
        EngineArgs(model_path=target, grammar_backend="outlines")


@pytest.fixture(scope="module")
def drafts(target, make_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("grammar_drafts")
    return {
        "eagle": build_eagle_draft(str(root / "eagle"), target, version=2),
        "eagle3": build_eagle_draft(str(root / "eagle3"), target, version=3),
        "mimo": add_mimo_mtp(make_model("qwen2", num_layers=2, seed=7)),
    }


SPECULATIVE = {
    "eagle-tree": dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path="eagle",
        speculative_num_steps=3,
        speculative_eagle_topk=3,
        speculative_num_draft_tokens=6,
    ),
    "eagle3": dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="eagle3",
        speculative_num_steps=2,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=4,
    ),
    "mtp": dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1),
    # The target drafting for itself proposes its unconstrained choices, which the grammar
    # often forbids: verify must reject them and still accept the allowed ones.
    "standalone-self": dict(
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="target",
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=5,
    ),
    "ngram": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6),
}
_PLAIN: dict[str, list] = {}


def _generate(path: str, **kwargs) -> tuple[list[dict], list[dict]]:
    """Greedy outputs, and sampled ones (temperature 1), for one prompt per constraint."""
    prompts = random_prompts(3, 2, 12, seed=4)
    params = [{"temperature": 0.0, "max_new_tokens": 48, **c} for c in CONSTRAINTS]
    sampled = [{**p, "temperature": 1.0, "max_new_tokens": 64} for p in params]
    with Engine(
        model_path=path, random_seed=0, constrained_json_disable_any_whitespace=True, **kwargs
    ) as engine:
        greedy = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        return greedy, engine.generate(input_ids=prompts, sampling_params=sampled)


@pytest.mark.parametrize("name", list(SPECULATIVE))
def test_speculative_greedy_equals_plain_constrained(name, target, drafts):
    kwargs = dict(SPECULATIVE[name])
    path = drafts["mimo"] if name == "mtp" else target
    draft = kwargs.get("speculative_draft_model_path")
    if draft is not None:
        kwargs["speculative_draft_model_path"] = target if draft == "target" else drafts[draft]
    if path not in _PLAIN:
        _PLAIN[path] = _generate(path)
    outs, sampled = _generate(path, **kwargs)
    plain = _PLAIN[path][0]
    for out, constraint in zip(sampled, CONSTRAINTS):  # tree rejection sampling, masked
        assert_parses(out, constraint)
    assert [o["output_ids"] for o in outs] == [p["output_ids"] for p in plain]
    for out, constraint in zip(outs, CONSTRAINTS):
        assert_parses(out, constraint)
        assert out["meta_info"]["spec_verify_ct"] > 0
    for out, ref in zip(outs, plain):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)


def test_tree_masks_equal_plain_masks_after_each_path(target):
    """Each verify row is masked as plain decoding would mask that position after the node's
    path: a tree grown from allowed tokens (deep JSON paths) plus a forbidden child per node,
    whose subtree no walk reaches and stays unmasked."""
    from transformers import AutoTokenizer

    from spec_engine.constrained.grammar import GrammarBackend
    from spec_engine.constrained.mask import mask_rows, mask_trees

    backend = GrammarBackend(AutoTokenizer.from_pretrained(target), 512, frozenset({2}), False)
    key = ("json", json.dumps(SCHEMA))
    g = torch.Generator().manual_seed(0)
    zeros = torch.zeros(1, 512)

    def allowed_after(path: list[int]) -> torch.Tensor:
        grammar = backend.grammar(key)
        for t in path:
            assert grammar.accept_token(t)
        return mask_rows(zeros, [grammar])[0] == 0

    parents, tokens, paths, reachable = [-1], [5], [[]], [True]
    for _ in range(24):  # grow: each new node under a random reachable node
        parent = int(torch.randint(len(parents), (1,), generator=g))
        while not reachable[parent]:
            parent = (parent + 1) % len(parents)
        ok = allowed_after(paths[parent]).nonzero().flatten()
        good = bool(torch.rand(1, generator=g) < 0.8) and len(ok) > 0
        pool = ok if good else (~allowed_after(paths[parent])).nonzero().flatten()
        token = int(pool[torch.randint(len(pool), (1,), generator=g)])
        parents.append(parent)
        tokens.append(token)
        paths.append(paths[parent] + [token])
        reachable.append(good and token != 2)  # nothing follows EOS: the request ends
    assert max(len(p) for p, r in zip(paths, reachable) if r) >= 4  # deep paths
    masked = mask_trees(torch.zeros(len(tokens), 512), [backend.grammar(key)], [parents], [tokens])
    for node, (path, ok) in enumerate(zip(paths, reachable)):
        want = allowed_after(path) if ok else torch.ones(512, dtype=torch.bool)
        assert torch.equal(masked[node] == 0, want), node


def test_engines_that_cannot_serve_grammars_say_why():
    """--tp-size > 1 (each rank would hold its own matchers) and --skip-tokenizer-init (nothing
    to compile against) refuse grammar requests with the reason; the backend otherwise."""
    from types import SimpleNamespace

    from spec_engine.constrained.grammar import NONE_BACKEND, create_grammar_backend

    def reason(backend="xgrammar", tokenizer="a tokenizer", tp_size=1):
        args = SimpleNamespace(
            grammar_backend=backend, constrained_json_disable_any_whitespace=False
        )
        return create_grammar_backend(args, tokenizer, 512, frozenset({2}), tp_size)[1]

    assert reason() is None
    assert reason(backend="none") == NONE_BACKEND
    assert "--skip-tokenizer-init" in reason(tokenizer=None)
    assert "--tp-size 1" in reason(tp_size=2)
