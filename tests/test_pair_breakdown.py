"""benchmarks/pair_breakdown.py (run by scripts/gpu_check.sh on the GPU machine's cores) runs end
to end on two local ranks: every loop timed, the pair's all_reduce result checked by the ranks,
and with --perf either a profile split into its categories or a line saying why there is none."""
import json
import os
import shutil
import subprocess
import sys

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "pair_breakdown.py")


def _perf_works(tmp_path):
    """Whether perf can record here (installed, and the kernel lets this user profile itself)."""
    perf = shutil.which("perf")
    if perf is None:
        return False
    probe = subprocess.run([perf, "record", "-q", "-o", str(tmp_path / "probe.data"), "--", "true"],
                           capture_output=True, timeout=60)
    return probe.returncode == 0


def test_pair_breakdown_times_every_loop(tmp_path):
    out = tmp_path / "pb.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, _SCRIPT, "--iters", "300", "--repeat", "2", "--perf",
                           "--launcher", "fork", "--job-timeout", "120", "--json", str(out)],
                          timeout=240, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["failures"] == []
    loops = ["forum loop", "torch.randn(10, 10)", "pair all_reduce", "group of one", "fc.get_rank()"]
    for name in loops:
        rounds = res["us"][name + " rounds"]
        assert len(rounds) == 2 and min(rounds) > 0, (name, rounds)
        assert min(rounds) <= res["us"][name] <= max(rounds), (name, res["us"][name], rounds)
    shares, top = res["profile"]
    if _perf_works(tmp_path):  # then the profile must be there, split into its categories
        assert shares is not None, top
        assert 95.0 <= sum(shares.values()) <= 100.5, shares
        assert "polling for the peer's message" in shares and "Python" in shares, shares
    else:
        assert shares is None and top.startswith("no profile:"), top
    assert "| pair all_reduce |" in proc.stdout
