"""scripts/train.py end to end on CPU with a local Ray: the RL loop with MTP speculation and
online MTP training, --debug-rollout-only (no megatron import), saved rollouts replayed with no
engine, and the --sglang-* passthrough refusing what it must."""

from __future__ import annotations

import json
import logging
import os
import subprocess

import pytest

from specrl.train_options import parse_args

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def task(rl_task):
    return rl_task


def base_args(model, data, out):
    return [
        "--hf-checkpoint",
        model,
        "--prompt-data",
        data,
        "--input-key",
        "input",
        "--label-key",
        "label",
        "--rm-type",
        "tiny",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "4",
        "--num-rollout",
        "2",
        "--output-dir",
        out,
        "--ray-num-cpus",
        "2",
        "--sglang-max-total-tokens",
        "2048",
        "--sglang-max-running-requests",
        "16",
    ]


NUM_ROLLOUT = 4


def loop_args(model, data, out):
    """The RL loop's config: TP 2 colocated, MTP speculation, the MTP layer trained online, the
    weights checked in the engines after every push, --save-hf every 2 rollouts, and
    batch-invariant engines (a request's samples do not depend on what it was batched with), so
    that tests/e2e/test_checkpoint.py can compare a resumed run with this one bit for bit."""
    argv = base_args(model, data, out) + [
        "--lr",
        "1e-3",
        "--enable-mtp-training",
        "--check-weight-update-equal",
        "--colocate",
        "--tensor-model-parallel-size",
        "2",
        "--actor-num-gpus-per-node",
        "2",
        "--ray-num-cpus",
        "4",
        "--sglang-speculative-algorithm",
        "EAGLE",
        "--sglang-speculative-num-steps",
        "2",
        "--sglang-speculative-eagle-topk",
        "1",
        "--sglang-cuda-graph-bs",
        "1",
        "2",
        "4",
        "8",
        "--sglang-enable-deterministic-inference",
        "--save-interval",
        "2",
        "--save-hf",
        os.path.join(out, "hf", "{rollout_id}"),
    ]
    argv[argv.index("--num-rollout") + 1] = str(NUM_ROLLOUT)
    return argv


def run(argv, code="from specrl.loop import main; main(sys.argv[1:])"):
    """`python -c code argv` (the loop's main by default) in a process forked from
    tests/support/forkserver.py's server, torch and the engine already imported there."""
    from tests.support.forkserver import python_c

    proc = python_c("import sys; " + code, argv, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_rl_loop_with_mtp_speculation_then_replay_without_engines(task, rl_loop_run, tmp_path):
    """The loop (loop_args; the run of tests/conftest.py that tests/e2e/test_checkpoint.py also
    compares a resumed run with), then its saved rollouts replayed with no engine."""
    model, data = task
    out, saved = rl_loop_run.out, rl_loop_run.saved_rollouts
    proc = rl_loop_run.finished()
    rows = metrics(out)
    # The weights each rollout was generated with.
    assert [r["rollout/weight_version"] for r in rows] == list(range(NUM_ROLLOUT))
    for r in rows:
        for key in (
            "rollout/raw_reward",
            "rollout/response_len/mean",
            "rollout/spec_accept_length",
            "train/loss",
            "train/pg_loss",
            "train/grad_norm",
            "train/mtp_loss",
            "perf/rollout_time",
            "perf/actor_train_time",
            "perf/update_weights_time",
            "perf/tokens_per_s",
        ):
            assert r[key] is not None, key
        assert abs(r["train/tis"] - 1.0) < 1e-3  # trainer and engine log-probs agree
        # synchronous: every trained token is of the weights being trained
        assert r["rollout/weight_version_lag/mean"] == r["rollout/weight_version_lag/max"] == 0
        assert 0 <= r["perf/rollout_tail_time"] < r["perf/rollout_time"]
    assert all(os.path.exists(saved.format(rollout_id=i)) for i in range(NUM_ROLLOUT))
    # The run explains itself: a closing summary read back from metrics.jsonl, and its plots.
    summary = proc.stdout[proc.stdout.index(f"run summary ({NUM_ROLLOUT} rollouts)") :]
    reward = [r["rollout/raw_reward"] for r in rows]
    accept = [r["rollout/spec_accept_length"] for r in rows]
    assert f"reward:         {reward[0]:.3f} -> {reward[-1]:.3f} (first -> last" in summary
    assert f"accept length:  {accept[0]:.2f} -> {accept[-1]:.2f} (first -> last" in summary
    assert f"train {sum(r['perf/actor_train_time'] for r in rows):.1f} s" in summary
    assert os.path.join(out, "metrics.jsonl") in summary
    for plot in ("reward.svg", "accept_length.svg"):
        path = os.path.join(out, "plots", plot)
        assert path in summary and open(path).read().startswith("<svg")
    # megatron's known warnings are filtered in the trainer's Ray workers too; no INFO on stderr.
    assert "megatron" not in proc.stderr and "all_gather_into_tensor" not in proc.stderr
    first = f"rollout 1/{NUM_ROLLOUT}"
    assert f"{first}: reward" in proc.stdout and first not in proc.stderr
    replay = str(tmp_path / "replay")
    run(
        base_args(model, data, replay)
        + [
            "--load-debug-rollout-data",
            saved,
            "--lr",
            "1e-3",
            "--actor-num-gpus-per-node",
            "2",  # two data-parallel ranks
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.01",  # a frozen reference model
            "--advantage-estimator",
            "reinforce_plus_plus_baseline",
            "--kl-coef",
            "0.01",
            # slime's bypass (the rollout's log-probs as the old policy's) and the mismatch metrics
            "--use-rollout-logprobs",
            "--get-mismatch-metrics",
        ],
    )
    rows = metrics(replay)
    assert len(rows) == 2 and all(
        r["train/grad_norm"] > 0 and r["rollout/raw_reward"] is not None for r in rows
    )
    # Rollout 0 was sampled with the weights the replay starts from: no mismatch but the
    # engine's float error; logged as every train/ metric.
    first = rows[0]
    assert first["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert abs(first["train/mis_kl"]) < 1e-3 and 0 <= first["train/mis_k3_kl"] < 1e-5
    assert first["train/tis_clipfrac"] == 0.0
    assert all(r["train/mis_training_ppl"] > 1 and r["train/ois"] > 0 for r in rows)
    assert all(r["train/kl"] is not None and r["train/entropy"] > 0 for r in rows)
    assert all(
        r["rollout/weight_version"] == 0 for r in rows
    )  # no engine was started, nothing pushed


def ref_load_args(ref_load: str) -> list[str]:
    """slime's start from --ref-load, the engines' weights checked after its push, and a KL loss
    to it (tests/conftest.py's partial_rollout_run adds these to its run)."""
    argv = ["--ref-load", ref_load, "--check-weight-update-equal"]
    return argv + ["--use-kl-loss", "--kl-loss-coef", "0.01"]


def test_a_run_starts_from_ref_load_in_the_trainer_and_the_engines(partial_rollout_run):
    """slime's start: --ref-load (here another checkpoint of the model) is where the policy
    begins, and it is pushed into the engines before the first rollout: that rollout's
    log-probs from the engines equal the trainer's (train/tis 1), and the first step's KL to the
    reference, which is --ref-load too, is 0. (A run shared with
    tests/e2e/test_partial_rollout_loop.py: the first rollout's trained groups were generated
    in it, whole.)"""
    out, _ = partial_rollout_run
    row = metrics(out)[0]
    assert abs(row["train/tis"] - 1.0) < 1e-3, row["train/tis"]
    assert abs(row["train/kl"]) < 1e-6, row["train/kl"]
    assert row["rollout/weight_version"] == 0 and row["train/grad_norm"] > 0


def test_debug_rollout_only_shuts_down_when_a_step_of_it_fails(rollout_only_run):
    """--debug-rollout-only never imports megatron and logs rollout metrics only; a failure
    closing the metrics log is reported (logged and raised) and the engines and Ray are still
    shut down (the shared run of tests/conftest.py, whose engine is also killed and hung: see
    tests/e2e/test_fault_tolerance.py)."""
    proc, out = rollout_only_run
    assert "shut down" in proc.stdout
    rows = metrics(out)
    assert len(rows) == 3
    assert all(
        "rollout/raw_reward" in r and not any(k.startswith("train/") for k in r) for r in rows
    )
    assert "closing the metrics log failed" in proc.stderr


def test_a_failing_shutdown_step_never_hides_the_error_that_ended_the_run(monkeypatch):
    """Every shutdown step runs and each failure is logged; a step's error is raised when the run
    had none, but the run's own error (a dead actor: main turns it into the message naming the
    checkpoint) is the one that leaves, not the failure on the way out."""
    import contextlib

    from rollout.router import EngineDied
    from specrl.loop import logger, shutdown_step

    # A handler on the loop's own logger, not caplog's on the root: an in-process run earlier in
    # the session (specrl.console.setup_logging) may have turned propagation off.
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, handler])

    def broken() -> None:
        raise RuntimeError("disk gone")

    ran = []
    with pytest.raises(EngineDied, match="engine 0 died"):
        with contextlib.ExitStack() as teardown:
            teardown.push(shutdown_step("stopping the engines", lambda: ran.append("engines")))
            teardown.push(shutdown_step("closing the metrics log", broken))
            raise EngineDied(0, "its actor was killed")
    assert ran == ["engines"]
    assert logged == ["closing the metrics log failed"]
    with pytest.raises(RuntimeError, match="disk gone"):
        with contextlib.ExitStack() as teardown:
            teardown.push(shutdown_step("stopping the engines", lambda: ran.append("engines")))
            teardown.push(shutdown_step("closing the metrics log", broken))
    assert ran == ["engines", "engines"]
    assert logged == ["closing the metrics log failed"] * 2


@pytest.mark.parametrize(
    "flag,needle",
    [
        (["--sglang-no-such-flag", "1"], "unknown engine flag --sglang-no-such-flag"),
        (
            ["--sglang-model-path", "X"],
            "--sglang-model-path is set by the launcher; use --hf-checkpoint",
        ),
        (["--sglang-random-seed", "3"], "use --seed"),
        (["--sglang-tp-size", "2"], "set by the launcher; use --rollout-num-gpus-per-engine"),
        (["--sglang-speculative-num-stpes", "3"], "did you mean --sglang-speculative-num-steps"),
        (["--sglang-speculative-num", "3"], "ambiguous engine flag --sglang-speculative-num"),
    ],
)
def test_engine_flags_refused_with_the_right_name(flag, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(
            [
                "--hf-checkpoint",
                "m",
                "--rollout-batch-size",
                "1",
                "--num-rollout",
                "1",
                "--output-dir",
                "o",
                *flag,
            ]
        )
    assert needle in str(e.value)


def test_seed_example_engine_flags_are_accepted():
    """Every --sglang-* flag in the slime/SGLang documents this project started from."""
    args = parse_args(
        [
            "--hf-checkpoint",
            "m",
            "--rollout-batch-size",
            "1",
            "--num-rollout",
            "1",
            "--output-dir",
            "o",
            "--sglang-speculative-algorithm",
            "EAGLE",
            "--sglang-speculative-num-steps",
            "3",
            "--sglang-speculative-eagle-topk",
            "1",
            "--sglang-speculative-num-draft-tokens",
            "4",
            "--sglang-max-running-requests",
            "32",
            "--sglang-disable-cuda-graph-padding",
            "--sglang-attention-backend",
            "torch_native",
            "--sglang-cuda-graph-bs",
            *map(str, [*range(1, 33), *range(40, 65, 8), *range(80, 161, 16)]),
        ]
    )
    assert args.sglang_speculative_num_steps == 3 and args.sglang_cuda_graph_bs[-1] == 160
    assert args.sglang_disable_cuda_graph_padding and args.sglang_max_running_requests == 32


@pytest.fixture(scope="module")
def launcher_checkpoints(make_model, task, tmp_path_factory):
    """Tiny stand-ins for the launchers' real checkpoints: --dry-run reads their configs."""
    from tiny.checkpoints import build_eagle_draft

    qwen3 = make_model("qwen3", head_dim=32)
    eagle3 = build_eagle_draft(str(tmp_path_factory.mktemp("eagle3")), qwen3, version=3)
    return {"qwen3": qwen3, "eagle3": eagle3, "mimo": task[0]}


@pytest.mark.parametrize(
    "script,env,needles",
    [
        (
            "scripts/run-qwen3-8B-eagle3.sh",
            {"HF_CHECKPOINT": "qwen3", "DRAFT": "eagle3"},
            [
                "speculative_algorithm='EAGLE3'",
                "tensor_model_parallel_size=2",
                "(LlamaForCausalLMEagle3), steps 3, topk 1, 4 draft tokens",
            ],
        ),
        (
            "scripts/run-mimo-7B-rl-mtp.sh",
            {"HF_CHECKPOINT": "mimo"},
            [
                "enable_mtp_training=True",
                "tensor_model_parallel_size=2",
                "mtp_num_layers=1",
                "(MiMoForCausalLM, 2 layers, 1 MTP layers)",
                "speculative EAGLE: draft MTP",
            ],
        ),
        (
            "scripts/run-qwen3-1.7B-1gpu.sh",
            {"HF_CHECKPOINT": "qwen3", "DRAFT": "qwen3"},
            [
                "speculative_algorithm='STANDALONE'",
                "tensor_model_parallel_size=1",
                "weight_sync_mode='tensor'",
                "mem_fraction_static=0.85",
                "speculative STANDALONE: draft STANDALONE",
            ],
        ),
    ],
)
def test_gpu_launchers_pass_flag_checks(script, env, needles, launcher_checkpoints):
    """The real-model launchers' flags all exist and validate: --dry-run builds every options
    class, reads the checkpoints' configs and resolves the draft tree."""
    paths = {k: launcher_checkpoints[v] for k, v in env.items()}
    proc = subprocess.run(
        ["bash", script, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **paths},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(n in proc.stdout for n in needles), proc.stdout[-2000:]


@pytest.mark.parametrize(
    "model,arch,name",
    [
        ("glm4.5", "glm4_moe", "Glm4MoeForCausalLM"),
        ("deepseek-v3", "deepseek_v3", "DeepseekV3ForCausalLM"),
    ],
)
def test_moe_mtp_launcher_passes_flag_checks(model, arch, name, tmp_path):
    """scripts/run-moe-mtp.sh with each MODEL: the trainer builds the family (--dry-run reads the
    config as the trainer does) and the engine drafts with its next-n layer."""
    from tiny.checkpoints import build_checkpoint

    path = build_checkpoint(
        str(tmp_path / arch), arch=arch, extra_config={"num_nextn_predict_layers": 1}
    )
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "label": "b"}\n')
    env = {"MODEL": model, "HF_CHECKPOINT": path, "DATA": str(data), "OUT": str(tmp_path / "o")}
    proc = subprocess.run(
        ["bash", "scripts/run-moe-mtp.sh", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"({name}, 2 layers, 1 MTP layers)" in proc.stdout, proc.stdout[-2000:]
    assert f"speculative EAGLE: draft MTP: {path} ({name}), steps 3, topk 1" in proc.stdout
    assert "enable_return_routed_experts=True" in proc.stdout
    assert "tensor_model_parallel_size=1" in proc.stdout
    # MoE trains at TP 2 (sequence parallel) on 2 trainer ranks; a TP size that does not divide
    # the heads or the experts' widths, or the trainer ranks, is refused before Ray starts.
    from specrl.train_options import check_checkpoints, parse_args

    argv = ["--hf-checkpoint", path, "--prompt-data", str(data), "--rollout-batch-size", "2"]
    argv += ["--num-rollout", "1", "--output-dir", str(tmp_path / "tp2")]
    two_ranks = ["--actor-num-gpus-per-node", "2"]
    check_checkpoints(parse_args([*argv, "--tensor-model-parallel-size", "2", *two_ranks]))
    with pytest.raises(SystemExit, match="1 trainer ranks .* not a multiple of"):
        check_checkpoints(parse_args([*argv, "--tensor-model-parallel-size", "2"]))
    with pytest.raises(SystemExit, match="tensor parallel size 3 does not divide"):
        check_checkpoints(parse_args([*argv, "--tensor-model-parallel-size", "3"]))


def test_dry_run_refuses_a_missing_draft_and_a_tree_too_big(task, tmp_path, capsys):
    """--dry-run reads the draft's config and checks the tree against SGLang's limits (the checks
    scripts/train.py runs before Ray, called in-process)."""
    from specrl.train_options import check_checkpoints, parse_args

    model, data = task
    base = base_args(model, data, str(tmp_path))

    def refusal(*extra: str) -> str:
        with pytest.raises(SystemExit) as exc:
            check_checkpoints(parse_args([*base, *extra, "--dry-run"]))
        return f"{exc.value} {capsys.readouterr().err}"

    missing = refusal(
        "--sglang-speculative-algorithm",
        "STANDALONE",
        "--sglang-speculative-draft-model-path",
        str(tmp_path / "nowhere"),
    )
    assert "no config.json in" in missing
    too_big = refusal(
        "--sglang-speculative-algorithm",
        "EAGLE",
        "--sglang-speculative-num-steps",
        "2",
        "--sglang-speculative-eagle-topk",
        "2",
        "--sglang-speculative-num-draft-tokens",
        "8",
        "--mtp-num-layers",
        "1",
    )
    assert "--speculative-num-draft-tokens 8 exceeds the 7 tokens" in too_big
    assert "--mtp-num-layers 2:" in refusal("--mtp-num-layers", "2")
    assert "is a dense model with no router" in refusal("--moe-aux-loss-coeff", "1e-4")


def test_colocate_refuses_nccl_weight_sync(task, tmp_path, monkeypatch):
    """Two NCCL ranks cannot share one GPU: --colocate with --weight-sync-mode distributed is
    refused before anything starts, naming the mode to use (specrl.loop's main, called
    in-process: it raises the SystemExit whose message the command prints)."""
    import specrl.loop

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started")

    monkeypatch.setattr(specrl.loop, "init_ray", no_ray)
    for name in ("setup_logging", "quiet_known_noise"):  # keep pytest's logging as it is
        monkeypatch.setattr(specrl.loop, name, lambda: None)
    model, data = task
    argv = base_args(model, data, str(tmp_path))
    argv += ["--colocate", "--weight-sync-mode", "distributed", "--dry-run"]
    with pytest.raises(SystemExit) as refused:
        specrl.loop.main(argv)
    assert "--weight-sync-mode tensor" in str(refused.value)
