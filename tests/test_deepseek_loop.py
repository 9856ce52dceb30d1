"""The RL loop on a tiny DeepSeek-V3-shaped model (MLA, a dense first layer then MoE with a shared
expert, one next-n MTP layer; specrl.tiny_run's "deepseek-v3", which `MODEL=deepseek-v3 bash
scripts/run-tiny-cpu.sh` runs): its next-n layer drafts the rollouts (EAGLE), is trained online
through megatron's MTP block and pushed back into the engine, checked by checksum, after every
rollout. (The MoE balance loss of such a step: tests/test_trainer_moe.py.)"""

from __future__ import annotations

import json

import pytest

from tests.test_train_loop import base_args, metrics, run

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def deepseek_task(make_model, tmp_path_factory) -> tuple[str, str]:
    """The run script's tiny DeepSeek-V3 (random; the session's tokenizer) and one tiny-task
    prompt, eight times."""
    from specrl.tiny_run import DEEPSEEK_V3_RUN

    model = make_model("deepseek_v3", **DEEPSEEK_V3_RUN)
    data = tmp_path_factory.mktemp("task") / "task.jsonl"
    data.write_text((json.dumps({"input": "copy: a", "label": "a"}) + "\n") * 8)
    return model, str(data)


@pytest.mark.slow
def test_deepseek_v3_loop_trains_its_mtp_layer_online(deepseek_task, tmp_path):
    model, data = deepseek_task
    out = str(tmp_path / "run")
    argv = base_args(model, data, out)
    argv[argv.index("--num-rollout") + 1] = "3"
    run(
        argv
        + [
            "--enable-mtp-training",
            "--check-weight-update-equal",
            # Greedy (top-1) sampling of the one prompt: every rollout holds the same responses
            # (and every group one reward: no policy gradient), so the MTP loss falls only if the
            # next-n layer learns, and accept lengths rise only if the engine drafts with it.
            "--rollout-top-k",
            "1",
            "--lr",
            "1e-3",
            "--draft-lr",
            "1e-2",
            "--sglang-speculative-algorithm",
            "EAGLE",
            "--sglang-speculative-num-steps",
            "2",
            "--sglang-speculative-eagle-topk",
            "1",
        ]
    )
    rows = metrics(out)
    # The engines took every push (--check-weight-update-equal compares the engine's checksum of
    # every tensor it holds, the next-n layer's included, with the pushed one, or fails the run).
    assert [r["rollout/weight_version"] for r in rows] == [0, 1, 2]
    mtp = [r["train/mtp_loss"] for r in rows]
    accept = [r["rollout/spec_accept_length"] for r in rows]
    assert mtp[2] < mtp[1] < mtp[0], mtp  # measured: 6.90, 2.99, 1.20
    # The random layer drafts nothing right; trained and pushed, all it drafts is accepted
    # (measured: 1.0, 3.0, 3.0 tokens per verify step; 3 is the most with 2 draft steps).
    assert accept[0] < 1.5 and max(accept[1:]) > 2.0, accept
    assert all(abs(r["train/tis"] - 1.0) < 1e-3 for r in rows)  # trainer and engine agree
