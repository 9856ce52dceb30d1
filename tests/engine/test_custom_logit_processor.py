"""SGLang's custom logit processors (--enable-custom-logit-processor): a processor serialized by
`to_str()` (dill) runs on the request's logits with its custom_params and "__req__"; speculative
verify shows each tree node the request as it stands at that node, so outputs equal plain
decoding's; off by default with SGLang's message; processors serialized against SGLang's own
base class load without SGLang installed."""

from __future__ import annotations

import sys

import pytest
import torch

from spec_engine import Engine
from spec_engine.core.custom_logit_processor import CustomLogitProcessor, ProcessorReq
from spec_engine.server.http_server import create_app

dill = pytest.importorskip("dill")
testclient = pytest.importorskip("fastapi.testclient")


def alternating(base: type) -> type:
    """SGLang's test processor shape: forces custom_params["token_id"] on even output positions
    and the next id on odd ones (it reads the output so far from "__req__")."""

    class Alternating(base):
        def __call__(self, logits, custom_param_list=None):
            assert logits.shape[0] == len(custom_param_list)
            for i, params in enumerate(custom_param_list):
                token = params["token_id"] + len(params["__req__"].output_ids) % 2
                logits[i, :] = float("-inf")
                logits[i, token] = 0.0
            return logits

    return Alternating


PARAMS = {"temperature": 1.0, "max_new_tokens": 12, "custom_params": {"token_id": 40}}
WANT = [40, 41] * 6


@pytest.fixture(scope="module")
def target(make_model) -> str:
    return make_model("llama", num_layers=2)


@pytest.mark.parametrize(
    "spec",
    [{}, {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}],
    ids=["plain", "ngram"],
)
def test_processor_runs_with_params_and_req(target, spec):
    processor = alternating(CustomLogitProcessor).to_str()
    with Engine(
        model_path=target, random_seed=0, enable_custom_logit_processor=True, **spec
    ) as engine:
        outs = engine.generate(
            input_ids=[[5, 6, 7], [40, 41, 40, 41, 9]],
            sampling_params=[PARAMS, {**PARAMS, "temperature": 0.0}],
            custom_logit_processor=[processor, processor],
            return_logprob=True,
        )
        free = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})
    for out in outs:
        assert out["output_ids"] == WANT
        assert all(lp == 0.0 for lp, _, _ in out["meta_info"]["output_token_logprobs"])
    assert free["output_ids"] != WANT[:4]  # a request without one is untouched
    if spec:  # the n-gram drafts followed the pattern: whole paths were accepted
        assert max(o["meta_info"]["spec_accept_length"] for o in outs) > 2


def test_off_by_default_and_bad_processors_are_400s(target):
    processor = alternating(CustomLogitProcessor).to_str()
    body = {"input_ids": [5, 6], "custom_logit_processor": processor}
    with Engine(model_path=target) as engine:
        r = testclient.TestClient(create_app(engine)).post("/generate", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "The server is not configured to enable custom logit processor. "
        "Please set `--enable-custom-logit-processor` to enable this feature."
    )
    with Engine(model_path=target, enable_custom_logit_processor=True) as engine:
        client = testclient.TestClient(create_app(engine))
        r = client.post("/generate", json={**body, "custom_logit_processor": '{"callable": "00"}'})
        assert r.status_code == 400 and "could not be loaded" in r.json()["error"]["message"]
        r = client.post(
            "/generate",
            json={**body, "sampling_params": {**PARAMS, "max_new_tokens": 4}},
        )
        assert r.status_code == 200 and r.json()["output_ids"] == WANT[:4]


# SGLang's class as its module defines it (sampling/custom_logit_processor.py), for a client.
SGLANG_SOURCE = """
import json
from abc import ABC, abstractmethod

import dill


class CustomLogitProcessor(ABC):
    @abstractmethod
    def __call__(self, logits, custom_param_list=None):
        raise NotImplementedError

    @classmethod
    def to_str(cls):
        return json.dumps({"callable": dill.dumps(cls).hex()})
"""


def test_processors_serialized_against_sglangs_class_load_without_sglang(monkeypatch, tmp_path):
    """A client with SGLang serializes its subclass with a reference to SGLang's base class; the
    engine, without SGLang, resolves it to its own."""
    package = tmp_path / "sglang" / "srt" / "sampling"
    package.mkdir(parents=True)
    for folder in (package.parent.parent, package.parent, package):
        (folder / "__init__.py").write_text("")
    (package / "custom_logit_processor.py").write_text(SGLANG_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor as SGLangBase

    payload = alternating(SGLangBase).to_str()
    for name in [m for m in sys.modules if m.split(".")[0] == "sglang"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    loaded = CustomLogitProcessor.from_str(payload)
    assert type(loaded).__mro__[1] is CustomLogitProcessor
    req = ProcessorReq("r", [], [], None)
    out = loaded(torch.zeros(2, 50), [{"token_id": 7, "__req__": req}] * 2)
    assert out.argmax(-1).tolist() == [7, 7]
