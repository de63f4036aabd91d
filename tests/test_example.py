"""example.py runs end to end against a tiny local checkpoint (no network)."""

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
import tiny_model as tm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_example_runs_on_tiny_checkpoint(tmp_path):
    path = tm.make_tiny_qwen3(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "example.py"), "--model", path, "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    # Both questions are answered, each with a finish reason.
    assert proc.stdout.count("\nQ: ") == 2
    assert proc.stdout.count("[length]") + proc.stdout.count("[stop]") == 2


def test_example_missing_model_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "nope")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "example.py"), "--model", missing],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert "does not exist" in proc.stderr and missing in proc.stderr
