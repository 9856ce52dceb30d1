"""Run SGLang's own server test files against `spec_engine.launch_server` with a tiny model.

SGLang's test files launch its server through `sglang.test.test_utils.popen_launch_server` and
name hub models (`DEFAULT_SMALL_MODEL_NAME_FOR_TEST`, ...). This script builds a tiny Llama
checkpoint and tokenizer (tiny.checkpoints, as the tests here do), then runs each test file in
its own process with `sglang.test.test_utils` patched:

* `popen_launch_server` starts `python -m spec_engine.launch_server --model-path M <the test's
  other_args as written> --host H --port P [--api-key K]` and waits for `/health_generate`, as
  SGLang's does (without the `--device` it appends);
* every `DEFAULT_*MODEL*` name is the tiny model; `DEFAULT_SMALL_MODEL_NAME_FOR_TEST` ends in
  `-Instruct`, and the same path without it is a second checkpoint with other weights (what
  `test_update_weights_from_disk.py` swaps to);
* `sglang.Engine` is `spec_engine.Engine` (the engine-mode tests build it in process).

The results go to a JSON file (per test: passed / failed / error / skipped and the failure's first
line) and a markdown table. SGLang itself is installed with `pip install --no-deps --target DIR`
(plus the pure-python packages its test utilities import; docs/benchmarks/sglang_suite.md has the
commands); DIR goes on the runner's `sys.path` only, never into the servers' environment. The
servers never import SGLang.

    python -m scripts.sglang_suite --sglang-dir /tmp/sglpkg --tests-dir /tmp/sglang \
        --json docs/benchmarks/data/sglang_suite.json --md TABLE
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import types
import unittest
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The test files of SGLang's HTTP server (paths under --tests-dir, SGLang's repository root).
DEFAULT_FILES = (
    "test/srt/test_srt_endpoint.py",
    "test/srt/test_abort.py",
    "test/registered/tokenizer/test_skip_tokenizer_init.py",
    "test/srt/rl/test_update_weights_from_disk.py",
    "test/registered/constrained/test_constrained_decoding.py",
    "test/registered/openai_server/features/test_json_mode.py",
    "test/registered/openai_server/features/test_openai_server_ebnf.py",
    "test/srt/openai_server/basic/test_openai_server.py",
)
TINY_NAME = "tiny-llama-Instruct"  # SGLang's tests derive a second model by dropping "-Instruct"


@dataclasses.dataclass
class SuiteConfig:
    sglang_dir: str  # the --target directory holding the installed `sglang` package
    tests_dir: str  # SGLang's repository root (or any folder holding the files under `files`)
    files: tuple[str, ...] = DEFAULT_FILES
    work_dir: str = ""  # tiny models and logs; a temporary folder when empty
    json_out: str = "docs/benchmarks/data/sglang_suite.json"
    md_out: str = ""
    file_timeout: float = 1800.0


def launcher_argv(
    model: str,
    base_url: str,
    other_args: list[Any] | tuple[Any, ...] | None = None,
    api_key: str | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The command `popen_launch_server(model, base_url, other_args=..., api_key=...)` runs here:
    SGLang's `sglang serve` command line with spec_engine's launcher in its place."""
    host, port = base_url.rsplit(":", 1)
    host = host.split("://", 1)[-1]
    argv = [python, "-m", "spec_engine.launch_server", "--model-path", model]
    argv += [str(a) for a in other_args or ()]
    argv += ["--host", host, "--port", port.strip("/")]
    if api_key:
        argv += ["--api-key", api_key]
    return argv


def build_models(work_dir: str) -> str:
    """The tiny model SGLang's tests get, and its `-Instruct`-less twin; returns the first."""
    from tiny.checkpoints import build_tiny_model

    path = os.path.join(work_dir, TINY_NAME)
    twin = path.replace("-Instruct", "")
    # A context for test_abort.py's 2048 new tokens (SGLang refuses prompt + max_new_tokens
    # beyond the context, and so does specrl), and no longer: a chat request without max_tokens
    # runs to the context, and a random model never stops by itself.
    for out, seed in ((path, 0), (twin, 1)):
        if not os.path.exists(os.path.join(out, "config.json")):
            build_tiny_model(out, max_position_embeddings=2304, seed=seed)
    return path


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A permissive stand-in for torchvision, which SGLang's multimodal code imports at module
    level: the text-only test utilities import without it (and without a CUDA build of it)."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: ANN001, ANN201
        module = _AnyModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0"
        return module

    def exec_module(self, module):  # noqa: ANN001, ANN201
        pass


class _Any:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Any:
        return _Any()

    def __getattr__(self, name: str) -> _Any:
        return _Any()

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _AnyModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


def _popen_launch_server(
    model: str,
    base_url: str,
    timeout: float,
    api_key: str | None = None,
    other_args: list | tuple | None = None,
    env: dict | None = None,
    return_stdout_stderr: tuple | None = None,
    **_ignored: Any,
) -> subprocess.Popen:
    """SGLang's popen_launch_server with spec_engine's launcher; ready once /health_generate
    answers 200, as SGLang's waits (polled every 0.5 s rather than 10)."""
    import requests

    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["PYTHONPATH"] = ROOT  # the servers run without SGLang on their path
    argv = launcher_argv(model, base_url, other_args, api_key)
    print("command=" + " ".join(argv), flush=True)
    out, err = return_stdout_stderr or (None, None)
    proc = subprocess.Popen(argv, env=child_env, stdout=out, stderr=err, cwd=ROOT)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise Exception(f"Server process exited with code {proc.returncode}")
        try:
            r = requests.get(base_url + "/health_generate", headers=headers, timeout=5)
            if r.status_code == 200:
                return proc
        except requests.RequestException:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("Server failed to start within the timeout period")


def _patch_sglang(model: str) -> None:
    """Point SGLang's test utilities at spec_engine and the tiny model (before a test file
    imports names from them)."""
    import sglang
    import sglang.test.test_utils as tu

    tu.popen_launch_server = _popen_launch_server
    _log_refusals()
    for name, value in list(vars(tu).items()):
        if name.startswith("DEFAULT_") and "MODEL" in name and isinstance(value, str):
            setattr(tu, name, model)
    from spec_engine.engine import Engine

    sglang.Engine = Engine


def _log_refusals() -> None:
    """Print the body of every 4xx/5xx answer the tests get (they mostly read a missing key
    of it, which says nothing of why)."""
    import requests

    send = requests.Session.send

    def logged_send(self: requests.Session, request: Any, **kwargs: Any) -> Any:
        response = send(self, request, **kwargs)
        if response.status_code >= 400 and not kwargs.get("stream"):
            print(f"HTTP {response.status_code} {request.url}: {response.text[:500]}", flush=True)
        return response

    requests.Session.send = logged_send


class _Recorder(unittest.TextTestResult):
    """Keeps each test's outcome and the first line of its failure."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict[str, str]] = {}
        self.class_errors: dict[str, str] = {}

    @staticmethod
    def _root(err: tuple) -> BaseException | None:
        exc = err[1]
        # CustomTestCase's retry wrapper re-raises its own error: report the test's.
        while exc is not None and exc.__context__ is not None and "retry()" in str(exc):
            exc = exc.__context__
        return exc

    def _first_line(self, err: tuple) -> str:
        exc = self._root(err)
        lines = traceback.format_exception_only(type(exc), exc) if exc else [err[0].__name__]
        text = "".join(lines).strip()
        return text.splitlines()[0][:300] if text else err[0].__name__

    def _put(self, test: unittest.TestCase, status: str, detail: str = "") -> None:
        if isinstance(test, unittest.case._SubTest):
            test, detail = test.test_case, f"{test._subDescription()}: {detail}"
        if not hasattr(test, "_testMethodName"):  # setUpClass / tearDownClass failures
            desc = str(test)  # "setUpClass (module.Class)"
            self.class_errors[desc.split("(")[-1].rstrip(")").split(".")[-1]] = detail
            return
        key = f"{type(test).__name__}.{test._testMethodName}"
        if key in self.outcomes and self.outcomes[key]["status"] != "passed":
            return  # a subtest failed first
        self.outcomes[key] = {"status": status, "detail": detail}

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._put(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: tuple) -> None:
        super().addFailure(test, err)
        self._put(test, "failed", self._first_line(err))

    def addError(self, test: unittest.TestCase, err: tuple) -> None:
        super().addError(test, err)
        failed = isinstance(self._root(err), AssertionError)
        self._put(test, "failed" if failed else "error", self._first_line(err))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._put(test, "skipped", reason)

    def addSubTest(self, test: unittest.TestCase, subtest: Any, err: tuple | None) -> None:
        super().addSubTest(test, subtest, err)
        if err is not None:
            status = "failed" if issubclass(err[0], test.failureException) else "error"
            self._put(subtest, status, self._first_line(err))


def _test_ids(suite: unittest.TestSuite) -> list[unittest.TestCase]:
    out = []
    for item in suite:
        out += _test_ids(item) if isinstance(item, unittest.TestSuite) else [item]
    return out


def run_one(path: str, model: str, sglang_dir: str, result_json: str) -> None:
    """Run one SGLang test file in this process (the child of `run_suite`)."""
    sys.path.insert(0, sglang_dir)
    sys.meta_path.insert(0, _StubFinder())
    _patch_sglang(model)
    # As SGLang's CI runs it (`python3 test_x.py`): the file is __main__, so dill serializes the
    # custom logit processors it defines by value; unittest.main() at its end is held off.
    module = types.ModuleType("__main__")
    module.__file__ = path
    sys.modules["__main__"] = module
    sys.path.insert(0, os.path.dirname(path))
    unittest_main, unittest.main = unittest.main, lambda *a, **k: None
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), module.__dict__)
    finally:
        unittest.main = unittest_main
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    tests = _test_ids(suite)
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=2, stream=sys.stdout)
    result = runner.run(suite)
    outcomes = {}
    for test in tests:
        key = f"{type(test).__name__}.{test._testMethodName}"
        class_error = result.class_errors.get(type(test).__name__, "not run")
        outcomes[key] = result.outcomes.get(key) or {"status": "error", "detail": class_error}
    with open(result_json, "w") as f:
        json.dump({"tests": outcomes, "class_errors": result.class_errors}, f, indent=1)


def run_suite(config: SuiteConfig) -> dict[str, Any]:
    """Build the tiny models, run every test file in its own process, one at a time."""
    work = config.work_dir or tempfile.mkdtemp(prefix="sglang-suite-")
    os.makedirs(work, exist_ok=True)
    model = build_models(work)
    env = dict(os.environ, PYTHONPATH=ROOT, SGLANG_TEST_MAX_RETRY="0")
    files: dict[str, Any] = {}
    for rel in config.files:
        path = os.path.join(config.tests_dir, rel)
        result_json = os.path.join(work, os.path.basename(rel) + ".json")
        log = os.path.join(work, os.path.basename(rel) + ".log")
        argv = [sys.executable, "-m", "scripts.sglang_suite", "--run-one", path, "--model", model]
        argv += ["--sglang-dir", config.sglang_dir, "--result", result_json]
        start = time.time()
        with open(log, "w") as out:
            try:
                subprocess.run(
                    argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                    timeout=config.file_timeout, start_new_session=True,
                )  # fmt: skip
                with open(result_json) as f:
                    files[rel] = json.load(f)
            except (subprocess.TimeoutExpired, OSError, ValueError) as e:
                files[rel] = {"tests": {}, "error": f"{type(e).__name__}: {e}"}
        files[rel]["seconds"] = round(time.time() - start, 1)
        files[rel]["log"] = log
        print(f"{rel}: {_counts(files[rel]['tests'])} in {files[rel]['seconds']} s", flush=True)
    return {"sglang_dir": config.sglang_dir, "model": model, "files": files}


def _counts(tests: dict[str, dict[str, str]]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for t in tests.values():
        counts[t["status"]] += 1
    return counts


def markdown(results: dict[str, Any]) -> str:
    """One row per test: file, test, status, the failure's first line."""
    rows = ["| file | test | status | first line of the failure |", "|---|---|---|---|"]
    for rel, res in results["files"].items():
        short = os.path.basename(rel)
        for test, got in res["tests"].items():
            detail = got["detail"].replace("|", "\\|").replace("\n", " ")
            rows.append(f"| `{short}` | `{test}` | {got['status']} | {detail} |")
        if res.get("error"):
            rows.append(f"| `{short}` | (the file) | error | {res['error']} |")
    return "\n".join(rows) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sglang-dir", help="the pip --target folder holding the sglang package")
    p.add_argument("--tests-dir", help="SGLang's repository root (the test files under it)")
    p.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="under --tests-dir")
    p.add_argument("--work-dir", default="", help="tiny models and logs (default: a temp dir)")
    p.add_argument("--json", default=SuiteConfig.json_out, help="per-test results")
    p.add_argument(
        "--md", dest="md_out", default="", help="also write the results as a markdown table"
    )
    p.add_argument("--file-timeout", type=float, default=SuiteConfig.file_timeout)
    # The child process that runs one file (run_suite starts it).
    p.add_argument("--run-one", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not args.sglang_dir:
        build_parser().error("--sglang-dir is required: the pip --target folder holding sglang")
    if args.run_one:
        run_one(args.run_one, args.model, args.sglang_dir, args.result)
        return
    if not args.tests_dir:
        build_parser().error("--tests-dir is required: SGLang's repository root")
    config = SuiteConfig(
        sglang_dir=args.sglang_dir,
        tests_dir=args.tests_dir,
        files=tuple(args.files),
        work_dir=args.work_dir,
        json_out=args.json,
        md_out=args.md_out,
        file_timeout=args.file_timeout,
    )
    results = run_suite(config)
    os.makedirs(os.path.dirname(os.path.abspath(config.json_out)), exist_ok=True)
    with open(config.json_out, "w") as f:
        json.dump(results, f, indent=1)
    if config.md_out:
        with open(config.md_out, "w") as f:
            f.write(markdown(results))


if __name__ == "__main__":
    main()
