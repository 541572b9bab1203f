"""The Lightning and accelerate snippets of docs/integrations.md (the README points there), run
as written on 2 ranks (under torchrun;
Lightning's also as `python script`, which starts the second rank itself), each
followed by a check that the job ran on fastcomm and that DDP kept the ranks' parameters equal.
Also the refusal it describes: accelerate's InitProcessGroupKwargs(backend="fastcomm")
on CPU. Skips where the packages are not installed (requirements-integrations.txt)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TIMEOUT_S = 150

# What each snippet leaves behind to check: the backend, the world and the trained parameters.
CHECKS = {
    "lightning": "params = trainer.lightning_module.parameters()\nworld = trainer.world_size\n",
    "accelerate": "params = model.parameters()\nworld = accelerator.num_processes\n",
}
REPORT = """
import torch.distributed as _dist
with open(f"check.{_dist.get_rank()}", "w") as _f:
    _f.write(f"backend={_dist.get_backend()} world={world} "
             f"params={[float(p.sum()) for p in params]}")
"""


def doc_snippet(name):
    text = open(os.path.join(ROOT, "docs", "integrations.md")).read()
    m = re.search(r"<!-- tested: " + re.escape(name) + r"\b.*?-->\n```python\n(.*?)```", text, re.S)
    assert m, f"docs/integrations.md has no tested block named {name!r}"
    return m.group(1)


def launch(script, cwd, launcher="torchrun"):
    """Runs ``script`` on 2 ranks (under torchrun, or ``python script`` for a script that starts
    its own ranks) in its own session with a hard timeout; (rc, output)."""
    cmd = ([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nnodes", "1",
            "--nproc-per-node", "2", "--monitor-interval", "0.1", str(script)]
           if launcher == "torchrun" else [sys.executable, str(script)])
    env = dict(os.environ, RES_OPTIONS="timeout:1 attempts:1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"{script}: no result within {RUN_TIMEOUT_S} s:\n{out[-4000:]}")
    return proc.returncode, out


@pytest.mark.parametrize("name,launcher", [("accelerate", "torchrun"), ("lightning", "torchrun"),
                                           ("lightning", "python")])
def test_readme_snippet_runs_on_fastcomm(tmp_path, name, launcher):
    pytest.importorskip(name, reason=f"{name} is not installed (requirements-integrations.txt)")
    script = tmp_path / f"{name}_snippet.py"
    script.write_text(doc_snippet(name) + CHECKS[name] + REPORT)
    rc, out = launch(script, tmp_path, launcher)
    assert rc == 0, out[-6000:]
    lines = [(tmp_path / f"check.{r}").read_text() for r in range(2)]
    assert all("backend=fastcomm world=2 " in l for l in lines), lines
    # DDP's gradient all_reduce ran: both ranks end with the same parameters.
    assert lines[0].split("params=")[1] == lines[1].split("params=")[1], lines


def test_accelerate_refuses_the_name_on_cpu(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (requirements-integrations.txt)")
    script = tmp_path / "refused.py"
    script.write_text(
        "import fastcomm\n"
        "from accelerate import Accelerator\n"
        "from accelerate.utils import InitProcessGroupKwargs\n"
        "Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend='fastcomm')])\n")
    rc, out = launch(script, tmp_path)
    # If this starts to pass, accelerate accepts the name: the advice in docs/integrations.md can go.
    assert rc != 0 and "Your assigned backend fastcomm is not available" in out, out[-4000:]
