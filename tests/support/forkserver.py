"""Fresh processes for tests, forked from one server process that has torch, megatron and the
engine imported: spawned, each process spent seconds of CPU importing them again."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from subprocess import CompletedProcess, TimeoutExpired
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch.multiprocessing as mp

# What the processes import; the server imports it once (the first time a test asks for it).
PRELOAD = [
    "torch",
    "megatron.core",
    "trainer_bridge.actor",
    "trainer_bridge.megatron_compat",
    "spec_engine",
    "spec_engine.distributed.launch",
    "bench.isolate",
    "spec_engine.launch_server",
    "uvicorn",
    "bench.rollout",
]


def context() -> BaseContext:
    """A multiprocessing context whose processes are forked from that server: a new process each,
    as spawned ones, that starts with PRELOAD imported and nothing of the test process (a fork
    of the test process itself inherits its threads, OpenMP's and gloo's, and crashed). They
    start with the server's environment (the test process's when the first test started it):
    pass what a process needs as arguments, not by changing os.environ. Their stdout and stderr
    are the server's; failures come back as exceptions, exit codes or the logs the helpers keep."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver")


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), each rank started from the server."""
    context()
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


@contextlib.contextmanager
def instead_of_spawn(module: ModuleType) -> Iterator[None]:
    """While open, the processes `module` starts with multiprocessing.get_context("spawn") (its
    only use of multiprocessing) start from the server, which starts now: its imports overlap
    the test's own work until the first process is asked for."""
    ctx = context()
    multiprocessing.forkserver.ensure_running()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "multiprocessing", SimpleNamespace(get_context=lambda _: ctx))
        yield


def _python_c(
    code: str, argv: list[str], stdout: str, stderr: str, cwd: str, session: bool = False
) -> None:
    if session:
        os.setsid()
    os.chdir(cwd)
    # Appended to, as the files of a shell's `>>`: several runs may share a log.
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if session else os.O_TRUNC)
    for stream, path in ((sys.stdout, stdout), (sys.stderr, stderr)):
        stream.flush()
        os.dup2(os.open(path, flags), stream.fileno())
    # No torch.distributed variables of an earlier test: the code starts its own.
    for name in [k for k in os.environ if k.startswith("MASTER_")]:
        del os.environ[name]
    sys.argv = ["-c", *argv]
    exec(code, {"__name__": "__main__"})


def python_c(
    code: str, argv: list[str], timeout: float, cwd: str | None = None
) -> CompletedProcess:
    """`python -c code *argv` in a process from the server, in `cwd` (the test's working
    directory by default) and with no MASTER_* variables; its exit code and output as
    subprocess.run(capture_output=True, text=True)'s."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout.log"), os.path.join(tmp, "stderr.log")
        args = (code, argv, out, err, cwd or os.getcwd())
        proc = context().Process(target=_python_c, args=args)
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise TimeoutError(f"python -c {code!r} ran over {timeout} s")
        with open(out) as o, open(err) as e:
            return CompletedProcess(["-c", code, *argv], proc.exitcode, o.read(), e.read())


def _main_code(module: str) -> str:
    return f"import runpy; runpy.run_module({module!r}, run_name='__main__')"


def run_main(module: str, argv: list[str], timeout: float) -> CompletedProcess:
    """`python -m module *argv`, as python_c."""
    return python_c(_main_code(module), argv, timeout)


class Session:
    """`python -m module *argv` from the server, running in a session of its own, as
    subprocess.Popen(start_new_session=True) would start it (os.killpg(pid, ...) reaches
    everything it starts: a Ray and its workers), its stdout and stderr appended to files: as a
    spawned one, without the seconds of CPU each spent importing torch, Ray and the loop."""

    def __init__(self, module: str, argv: list[str], stdout: str, stderr: str) -> None:
        self.args = ["-m", module, *argv]
        self._proc = context().Process(
            target=_python_c,
            args=(_main_code(module), argv, stdout, stderr, os.getcwd(), True),
        )
        self._proc.start()
        self.pid: int = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (negative: the signal that ended it), as Popen.wait's."""
        self._proc.join(timeout)
        if self.poll() is None:
            raise TimeoutExpired(self.args, timeout)
        return self.returncode
