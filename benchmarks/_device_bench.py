"""What the device benchmarks (device_streams, device_ipc, device_graphs, nccl_pairs) share: their
common options, and how a rank takes its device, real or the CPU fake of CUDA/NCCL."""
from __future__ import annotations

import os
import sys

from _launch import add_launcher_arg, use_launcher


def add_device_args(ap, job_timeout):
    """--fake, --json, --job-timeout and --launcher (spawn by default: how users start ranks
    that use CUDA)."""
    ap.add_argument("--fake", action="store_true")
    ap.add_argument("--json", help="write the per-rank results here")
    ap.add_argument("--job-timeout", type=float, default=job_timeout, help="seconds before a hung job is killed")
    add_launcher_arg(ap, default="spawn")


def parse_device_args(ap):
    """ap's arguments, with the launcher they name in use; a --world must be even (pairs)."""
    args = ap.parse_args()
    if getattr(args, "world", 0) % 2:
        sys.exit("--world must be even (pairs)")
    use_launcher(args.launcher)
    return args


def take_device(rank, world, fake, tag):
    """Sets this rank up on its device, before any NCCL use: the CPU fake (fake: CPU tensors), or
    GPU rank % count, where ranks sharing a GPU each get an NCCL_HOSTID of their own (NCCL needs
    one per rank; ``tag`` names the script in it). Returns the tensors' device ("cpu" or
    "cuda") and the synchronize of that device."""
    import torch

    if fake:
        os.environ["FASTCOMM_FAKE_DEVICE"] = "1"

        def sync():
            import fastcomm as fc

            fc._state._engine.device_synchronize("cpu")

        return "cpu", sync
    ndev = torch.cuda.device_count()
    if ndev == 0:
        raise RuntimeError("no CUDA device visible (--fake runs the fastcomm side on the CPU fake)")
    if ndev < world:
        os.environ["NCCL_HOSTID"] = f"{tag}-{os.getppid()}-{rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    torch.cuda.set_device(rank % ndev)
    return "cuda", torch.cuda.synchronize
