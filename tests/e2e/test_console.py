"""What a run prints: megatron-core's known warnings and the known third-party log notices are
filtered, and nothing else is."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from specrl.console import NOISY_LOGS, quiet_known_noise
from trainer_bridge.megatron_compat import filter_known_warnings


def warn_from(module: str, message: str, category: type[Warning]) -> None:
    """A warning as if `module` had issued it (filters match on the issuing module)."""
    warnings.warn_explicit(
        message,
        category,
        filename=module.replace(".", "/") + ".py",
        lineno=1,
        module=module,
        registry={},
    )


TE = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
# (issuing module, message, category) of warnings megatron-core runs print and no run can act on.
DROPPED = [
    (
        "megatron.core.transformer.transformer_config",
        "full scope is deprecated. Use empty",
        UserWarning,
    ),
    (
        "megatron.core.tensor_parallel.layers",
        "Warning: tp_group is None, using",
        DeprecationWarning,
    ),
    (
        "torch.distributed.c10d_logger",
        "`torch.distributed.all_gather_into_tensor` is deprecated.",
        FutureWarning,
    ),
]
# Dropped only without CUDA, where Transformer Engine and Apex cannot be installed.
DROPPED_ON_CPU = [
    ("megatron.core.optimizer", TE, UserWarning),
    ("megatron.core.models.backends", "Apex is not installed. Falling back", UserWarning),
    (
        "megatron.core.tensor_parallel.layers",
        "When using async grad allreduce it is recommended "
        "to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1",
        UserWarning,
    ),
]
# Kept: another megatron warning, the same text from another package, or of another category.
KEPT = [
    ("megatron.core.optimizer", "grad norm is NaN", UserWarning),
    ("mypackage.train", TE, UserWarning),
    ("megatron.core.optimizer", TE, RuntimeWarning),
]


def test_megatron_known_warnings_are_dropped_and_others_kept():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_known_warnings()
        for module, message, category in DROPPED + DROPPED_ON_CPU + KEPT:
            warn_from(module, message, category)
    expected = (DROPPED_ON_CPU if torch.cuda.is_available() else []) + KEPT
    assert [(str(w.message), w.category) for w in caught] == [(m, c) for _, m, c in expected]


@pytest.fixture
def records():
    """Records reaching the NOISY_LOGS loggers' handlers; the loggers' filters are restored."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    loggers = [logging.getLogger(name) for name in NOISY_LOGS]
    saved = [(lg, list(lg.filters), lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.WARNING)
    yield seen
    for lg, filters, level in saved:
        lg.removeHandler(handler)
        lg.filters[:] = filters
        lg.setLevel(level)


def test_known_log_notices_are_dropped_and_others_kept(records):
    quiet_known_noise()
    quiet_known_noise()  # idempotent: one filter per logger
    config = logging.getLogger("transformers.configuration_utils")
    assert len(config.filters) == 1
    config.warning(
        "You are using a model of type `mimo` to instantiate a model of type ``. This "
        "may be expected"
    )
    config.warning("You are using a model of type `mimo` to instantiate a model of type `llama`.")
    ray_auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    ray_auth.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE")
    ray_auth.warning("Token authentication is disabled for this Ray cluster. Anyone with access")
    assert records == [
        "You are using a model of type `mimo` to instantiate a model of type `llama`.",
        "Token authentication is disabled for this Ray cluster. Anyone with access",
    ]
