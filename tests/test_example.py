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


def _set_template(path: str, template: str) -> None:
    import json

    cfg_file = os.path.join(path, "tokenizer_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)


def test_example_runs_on_a_template_without_the_thinking_switch(tmp_path):
    """Llama 3's and Qwen2.5's templates do not read enable_thinking: the example passes it only
    to templates that do (before, the chat raised on every such checkpoint)."""
    path = tm.make_tiny_qwen3(tmp_path / "ckpt")
    _set_template(path, "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "example.py"), "--model", path, "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\nQ: ") == 2


def test_example_turns_an_error_into_one_line(tmp_path):
    path = tm.make_tiny_qwen3(tmp_path / "ckpt")
    _set_template(path, "{{ messages[0]['content'] }}{{ raise_exception('this template refuses every chat') }}")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "example.py"), "--model", path, "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error: ")]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert "the chat template could not render" in lines[0] and "refuses every chat" in lines[0]
