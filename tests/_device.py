"""What the device-path test files share: the device under test (the CPU fake of CUDA/NCCL,
or a GPU with FASTCOMM_DEVICE_TEST=cuda, as scripts/gpu_check.sh runs them), the ranks'
environment and setup, and the host's wait for the caller's stream."""
from __future__ import annotations

import os

import pytest
import torch

import fastcomm as fc

DEV = os.environ.get("FASTCOMM_DEVICE_TEST", "cpu")
ON_GPU = DEV == "cuda"
ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"} if ON_GPU else {"FASTCOMM_FAKE_DEVICE": "1"}
fake_only = pytest.mark.skipif(ON_GPU, reason="uses the fake runtime's test hooks")
# Same-host pair channels are NCCL communicators or IPC links (FASTCOMM_DEVICE_IPC); the
# collectives must not care which.
channels = pytest.mark.parametrize("channel", [{"FASTCOMM_DEVICE_IPC": "0"}, {"FASTCOMM_DEVICE_IPC": "1"}],
                                   ids=["nccl", "ipc"])


def setup(rank):
    if ON_GPU:  # before any NCCL use: NCCL reads the host id once per process
        os.environ["NCCL_HOSTID"] = f"fastcomm-host{rank}"
        torch.cuda.set_device(0)


def dsync():
    """What reading a CUDA tensor on the host does first: wait for the caller's stream (the
    fake's runs asynchronously, as a GPU's does)."""
    if ON_GPU:
        torch.cuda.synchronize()
    else:
        fc._state._engine.device_synchronize("cpu")
