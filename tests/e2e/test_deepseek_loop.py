"""The RL loop on a tiny DeepSeek-V3-shaped model (MLA, a dense first layer then MoE with a shared
expert, one next-n MTP layer; tiny.run_assets's "deepseek-v3", which `MODEL=deepseek-v3 bash
scripts/run-tiny-cpu.sh` runs) and a GLM-4.5-shaped one ("glm4.5": GQA, the same MoE), the latter
also moving its routers' expert bias every step: the next-n layer drafts the rollouts (EAGLE), is
trained online through megatron's MTP block and pushed back into the engine, checked by
checksum, after every rollout. (The MoE balance loss and the bias rule of such a step:
tests/trainer/test_trainer_moe.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.conftest import LoopRun
from tests.e2e.test_train_loop import base_args, metrics

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> str:
    """One tiny-task prompt, eight times."""
    data = tmp_path_factory.mktemp("task") / "task.jsonl"
    data.write_text((json.dumps({"input": "copy: a", "label": "a"}) + "\n") * 8)
    return str(data)


# The run script's tiny models (random; the session's tokenizer); GLM-4.5 moves its expert bias
# and trains packed, in micro batches of at most 30 tokens (slime's dynamic batch size).
GLM45_FLAGS = ["--moe-router-bias-update-rate", "1e-2", "--qkv-format", "thd"]
GLM45_FLAGS += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "30"]


# The flags of both runs. Greedy (top-1) sampling of the one prompt: every rollout holds the same
# responses (and every group one reward: no policy gradient), so the MTP loss falls only if the
# next-n layer learns, and accept lengths rise only if the engine drafts with it.
MTP_FLAGS = ["--enable-mtp-training", "--check-weight-update-equal", "--rollout-top-k", "1"]
MTP_FLAGS += ["--lr", "1e-3", "--draft-lr", "1e-2", "--sglang-speculative-algorithm", "EAGLE"]
MTP_FLAGS += ["--sglang-speculative-num-steps", "2", "--sglang-speculative-eagle-topk", "1"]
ARCHS = {"deepseek_v3": [], "glm4_moe": GLM45_FLAGS}


@pytest.fixture(scope="module")
def moe_runs(task, make_model, tmp_path_factory) -> Iterator[dict[str, LoopRun]]:
    """Both runs side by side (each spends much of its time waiting on its Ray, engine and
    trainer starting), the second started once the first's Ray is up: two Ray startups at once
    may time out."""
    from tiny.run_assets import MOE_RUN

    runs: dict[str, LoopRun] = {}
    try:
        for arch, extra in ARCHS.items():
            model = make_model(arch, **MOE_RUN)
            root = tmp_path_factory.mktemp(arch)
            out = str(root / "run")
            argv = base_args(model, task, out) + extra + MTP_FLAGS
            argv[argv.index("--num-rollout") + 1] = "3"
            for earlier in runs.values():
                earlier.ray_started()
            runs[arch] = LoopRun(argv, str(root), out)
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_moe_loop_trains_its_mtp_layer_online(arch, moe_runs):
    moe_runs[arch].finished(timeout=300)
    rows = metrics(moe_runs[arch].out)
    # The engines took every push (--check-weight-update-equal compares the engine's checksum of
    # every tensor it holds, the next-n layer's and the routers' bias included, with the pushed
    # one, or fails the run).
    assert [r["rollout/weight_version"] for r in rows] == [0, 1, 2]
    mtp = [r["train/mtp_loss"] for r in rows]
    accept = [r["rollout/spec_accept_length"] for r in rows]
    assert mtp[2] < mtp[1] < mtp[0], mtp  # measured: 6.90, 2.99, 1.20
    # The random layer drafts nothing right; trained and pushed, all it drafts is accepted
    # (measured: 1.0, 3.0, 3.0 tokens per verify step; 3 is the most with 2 draft steps).
    assert accept[0] < 1.5 and max(accept[1:]) > 2.0, accept
    # Trainer and engine agree: on the expert bias too, which moved before rollouts 1 and 2.
    assert all(abs(r["train/tis"] - 1.0) < 1e-3 for r in rows)
