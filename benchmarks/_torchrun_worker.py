"""A rank of a benchmark job under torchrun (_launch.py's torchrun launcher).

    python -m torch.distributed.run --standalone --nproc-per-node=N _torchrun_worker.py SPEC

SPEC is a pickle from the launcher: the benchmark script that defines the body, the body's name,
its arguments and the folder the result goes to. The script is loaded as a module under another
name than __main__, so its main() does not run; the store comes from env:// (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and the agent's store, as init_process_group would use them)."""
import importlib.util
import os
import pickle
import sys


def main():
    with open(sys.argv[1], "rb") as f:
        spec = pickle.load(f)
    sys.path[:] = spec["sys_path"]
    rank = int(os.environ["RANK"])
    with open(os.path.join(spec["outdir"], f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))  # for the launcher's kill of a hung job
    if spec["module"] == "__main__":
        loader = importlib.util.spec_from_file_location("__bench_main__", spec["script"])
        module = importlib.util.module_from_spec(loader)
        # Bodies and arguments pickled by reference to the script's __main__ resolve here.
        sys.modules["__main__"] = sys.modules["__bench_main__"] = module
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(spec["module"])
    from datetime import timedelta

    import torch.distributed as dist

    import _launch

    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=60)))
    store = dist.PrefixStore("fastcomm-bench/", store)
    _launch.run_rank(getattr(module, spec["body"]), rank, world, store, pickle.loads(spec["args"]),
                     spec["outdir"])


if __name__ == "__main__":
    main()
