"""What a run prints: specrl's own progress on stdout, warnings on stderr, and the third-party
notices that every run would print and none can act on filtered out (in Ray workers too)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from trainer_bridge.megatron_compat import filter_known_warnings

FORMAT = "%(asctime)s %(name)s: %(message)s"
# Log records dropped, by logger and a piece of their message: reading config.json through
# transformers' untyped base config (tokenizer loading does) warns that a model type it does not
# know, such as `mimo`, "instantiates a model of type ``"; a new local Ray warns that it enabled
# token authentication, its default.
NOISY_LOGS = {
    "transformers.configuration_utils": "to instantiate a model of type ``.",
    "ray._private.authentication.authentication_token_setup": "Token authentication is enabled",
}


def setup_logging() -> None:
    """specrl's INFO lines (loggers "specrl.*") to stdout, its warnings and those of any library
    to stderr; other libraries' INFO lines are dropped."""
    logging.basicConfig(level=logging.WARNING, format=FORMAT)
    specrl = logging.getLogger("specrl")
    if not specrl.handlers:
        out = logging.StreamHandler(sys.stdout)
        out.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        out.addFilter(lambda record: record.levelno < logging.WARNING)
        err = logging.StreamHandler(sys.stderr)
        err.setFormatter(logging.Formatter(FORMAT))
        err.setLevel(logging.WARNING)
        for handler in (out, err):
            specrl.addHandler(handler)
    specrl.setLevel(logging.INFO)
    specrl.propagate = False  # the root handler would print its INFO lines to stderr too


def quiet_known_noise() -> None:
    """Filter megatron-core's known warnings and the NOISY_LOGS records; the launcher runs this
    in every Ray worker too (a worker_process_setup_hook)."""
    filter_known_warnings()
    for name, text in NOISY_LOGS.items():
        logging.getLogger(name).addFilter(_Drop(text))


@dataclass(frozen=True)  # equal filters are added once: calling quiet_known_noise again is a no-op
class _Drop:
    """Drops the records whose message contains `text`."""

    text: str

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()
