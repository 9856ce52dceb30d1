"""scripts/sglang_suite.py without SGLang installed: the command its popen_launch_server runs is
SGLang's `sglang serve` line with spec_engine's launcher, and spec_engine's parser reads it (the
suite itself needs downloads and runs outside CI: docs/benchmarks/sglang_suite.md)."""

from __future__ import annotations

import sys

from scripts.sglang_suite import DEFAULT_FILES, build_parser, launcher_argv
from spec_engine.args.engine_args import from_cli_args
from spec_engine.launch_server import build_parser as server_parser


def test_launcher_argv_is_sglangs_command_line_for_spec_engine():
    # test_abort.py passes ints in other_args ("--max-running-requests", 8); SGLang str()s them.
    argv = launcher_argv(
        "/m/tiny-llama-Instruct",
        "http://127.0.0.1:21000",
        ["--max-running-requests", 8, "--schedule-policy", "random"],
        api_key="sk-123456",
    )
    assert argv[:3] == [sys.executable, "-m", "spec_engine.launch_server"]
    assert argv[3:] == [
        "--model-path", "/m/tiny-llama-Instruct",
        "--max-running-requests", "8", "--schedule-policy", "random",
        "--host", "127.0.0.1", "--port", "21000", "--api-key", "sk-123456",
    ]  # fmt: skip
    args = from_cli_args(server_parser().parse_args(argv[3:]))
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 21000, "sk-123456")
    assert args.max_running_requests == 8 and args.schedule_policy == "random"
    assert "--api-key" not in launcher_argv("m", "http://localhost:30000")


def test_suite_parser_defaults_to_sglangs_server_test_files():
    args = build_parser().parse_args(["--sglang-dir", "/tmp/sglpkg", "--tests-dir", "/tmp/sgl"])
    assert tuple(args.files) == DEFAULT_FILES
    assert "test/srt/test_srt_endpoint.py" in DEFAULT_FILES
