"""bench.py: the workload is nano-vllm's, the floor formula counts what it says, and the script
runs end to end (on a tiny checkpoint here; real numbers come from the H200)."""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
import tiny_model as tm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
from nanovllm.config import load_hf_config  # noqa: E402


def test_workload_is_nano_vllms():
    prompts, max_tokens = bench.workload()
    assert len(prompts) == 256 and sum(max_tokens) == 133_966
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in max_tokens)
    assert all(0 <= t <= 10000 for p in prompts for t in p)


def test_floor_matches_the_issue_figures():
    prompts, max_tokens = bench.workload()
    for name, tok_s in (("qwen3-0.6b", 38_000), ("qwen3-8b", 16_600)):
        cfg = load_hf_config(os.path.join(ROOT, bench.DUMMY_CONFIGS[name]))
        floor = bench.roofline_floor(cfg, prompts, max_tokens, 2, 4.3e12)
        assert abs(sum(max_tokens) / floor - tok_s) / tok_s < 0.01


def test_floor_counts_kv_reads_and_weight_reads():
    cfg = load_hf_config(os.path.join(ROOT, bench.DUMMY_CONFIGS["qwen3-0.6b"]))
    one = bench.roofline_floor(cfg, [[0] * 10], [1], 2, 1.0)
    two = bench.roofline_floor(cfg, [[0] * 10], [2], 2, 1.0)
    kv_per_token = 2 * 28 * 8 * 128 * 2
    # One more generated token reads 11 tokens of K/V and the weights once more.
    assert two - one == 11 * kv_per_token + (one - 10 * kv_per_token)


def test_bench_runs_on_a_tiny_checkpoint(tmp_path):
    path = tm.make_tiny_qwen3(tmp_path / "ckpt", vocab_size=10_001)  # the workload's ids go up to 10000
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--model", path, "--num-seqs", "3",
                           "--max-input-len", "120", "--max-output-len", "104", "--block-size", "16",
                           "--latency", "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    prompts, max_tokens = bench.workload(3, 120, 104)
    assert res["output_tokens"] == sum(max_tokens)
    assert res["output_tok_s"] > 0 and res["seconds"] > 0
    assert 0 <= res["fraction_of_floor"] <= 1 and res["floor_s"] >= 0  # tiny model on a CPU: ~0
    assert res["decode_ms_per_token_bs1"] > 0


def test_startup_profile_names_where_the_cold_start_goes(tmp_path):
    path = tm.make_tiny_qwen3(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--model", path, "--profile-startup"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "cumulative" in proc.stdout and "model_runner.py" in proc.stdout
