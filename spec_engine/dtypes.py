"""The dtype names of the engine's --dtype (and of get_server_info's `dtype`) and their torch
dtypes: the engine builds its model in one (runner.model_runner), and the trainer's weight check
compares the tensors it sent in the engine's (trainer_bridge.weight_sync)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
