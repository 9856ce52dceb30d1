"""slime's rollout health checks (--use-fault-tolerance): while a rollout runs, every engine is
asked for a one-token generation (SGLang's /health_generate) every --rollout-health-check-interval
seconds; one that does not answer within --rollout-health-check-timeout is hung, so its actor is
killed. Its requests then fail as a dead engine's do, and the router restarts it
(specrl.fault_tolerance.EngineRestarter) and sends them again. The first check waits
--rollout-health-check-first-wait seconds after the monitor starts (slime: time for a large model
to compile on its first requests). Between rollouts nothing is checked: weight pushes and a
colocated trainer's step may hold an engine legitimately.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)


class EngineHung(Exception):
    """An engine did not answer a health check in time."""


def ray_health_check(actor: Any, timeout: float) -> None:
    """One-token generation on an EngineActor; raises EngineHung past `timeout` seconds. A dead
    actor's error is left to the router, which notices it on the requests it held."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        ray.get(actor.health_generate.remote(), timeout=timeout)
    except GetTimeoutError:
        raise EngineHung(f"no answer to a one-token generation within {timeout} s") from None
    except RayActorError:
        pass


def ray_kill(actor: Any) -> None:
    import ray

    ray.kill(actor, no_restart=True)


class HealthMonitor:
    """Checks `engines.actors` from a daemon thread while `active()`; kills a hung one."""

    def __init__(
        self,
        engines: Any,
        interval: float,
        timeout: float,
        first_wait: float,
        check: Callable[[Any, float], None] = ray_health_check,
        kill: Callable[[Any], None] = ray_kill,
    ) -> None:
        self.engines, self.interval, self.timeout = engines, interval, timeout
        self.check, self.kill = check, kill
        self.killed = 0  # hung engines killed over the run
        self._first_check_at = time.monotonic() + first_wait
        self._active = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-health", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Check the engines while the block runs (a rollout or an evaluation)."""
        self._active.set()
        try:
            yield
        finally:
            self._active.clear()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stopped.wait(self.interval):
            if time.monotonic() >= self._first_check_at:
                self.check_once()  # which checks nothing unless a rollout runs

    def check_once(self) -> None:
        """One round: each engine checked in turn; a hung one is killed."""
        for index, actor in enumerate(list(self.engines.actors)):
            if not self._active.is_set():
                return  # the rollout ended meanwhile: an engine may now be busy on purpose
            if index in self.engines.restarting:
                continue  # loading, then taking the policy's weights: it cannot answer yet
            try:
                self.check(actor, self.timeout)
            except EngineHung as e:
                if not self._active.is_set():
                    return
                logger.warning(
                    "engine %d is hung (%s): killing it; --use-fault-tolerance restarts it and "
                    "sends its requests again",
                    index,
                    e,
                )
                self.killed += 1
                self.kill(actor)
            except Exception:  # a failed check must not end the monitor; the next one retries
                logger.exception("health check of engine %d failed", index)
