"""LoRA adapters through the server (serve/lora_modules.py), with the official `openai` client
(a server subprocess on 127.0.0.1, tiny random Qwen3 in float32 on CPU): adapters given with
--lora-modules and loaded / unloaded at run time are listed as models, and a request whose
`model` names one generates PEFT's greedy tokens; the base model stays the base; clear errors."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("fastapi")
peft = pytest.importorskip("peft")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402
from test_lora import adapter  # noqa: E402

from nanovllm.serve.launcher import ServerProcess  # noqa: E402
from nanovllm.serve.lora_modules import LoraModules, parse_lora_module  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--device", "cpu", "--dtype", "float32", "--kvcache-block-size", "16", "--num-kvcache-blocks", "128",
        "--log-level", "warning", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_lora")
    base = tm.make_tiny_qwen3(d / "base", num_layers=2, seed=31)
    prompt = list(range(3, 14))
    want = {"base": tm.hf_greedy(tm.load_hf_model(base), prompt, 8)}
    for name, seed, r in (("a1", 1, 4), ("a2", 2, 8)):
        want[name] = tm.hf_greedy(adapter(base, d / name, r, 16, seed=seed), prompt, 8)
    assert want["a1"] != want["base"] != want["a2"]  # (each adapter changes the greedy tokens)
    adapter(base, d / "big", 16, 16, seed=3)  # rank 16 > --max-lora-rank 8
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = ServerProcess(base, ARGS + ["--lora-modules", f"a1={d / 'a1'}"], timeout=180, cwd=ROOT, env=env)
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", timeout=60, max_retries=0)
    yield base, d, prompt, want, proc.url, client
    proc.stop(30)


def test_adapters_are_models_and_requests_pick_them_by_name(served):
    base, d, prompt, want, url, client = served
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {base, "a1"} and cards["a1"].parent == base
    got_a1, r = _tokens(client, "a1", prompt)
    assert got_a1 == want["a1"] and r.model == "a1"
    assert _tokens(client, base, prompt)[0] == want["base"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", prompt=prompt, max_tokens=2)


def test_load_and_unload_at_run_time(served):
    base, d, prompt, want, url, client = served
    post = lambda route, body: httpx.post(f"{url}/v1/{route}", json=body, timeout=60)  # noqa: E731
    r = post("load_lora_adapter", {"lora_name": "a2", "lora_path": str(d / "a2")})
    assert r.status_code == 200, r.text
    assert "a2" in {m.id for m in client.models.list().data}
    assert _tokens(client, "a2", prompt)[0] == want["a2"]
    assert post("load_lora_adapter", {"lora_name": "a2", "lora_path": str(d / "a1")}).status_code == 400
    missing = post("load_lora_adapter", {"lora_name": "a3", "lora_path": str(d / "nowhere")})
    assert missing.status_code == 400 and "no folder" in missing.json()["error"]["message"]
    big = post("load_lora_adapter", {"lora_name": "big", "lora_path": str(d / "big")})
    assert big.status_code == 400 and "max-lora-rank" in big.json()["error"]["message"]
    assert post("unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
    assert post("unload_lora_adapter", {"lora_name": "a2"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", prompt=prompt, max_tokens=2)
    assert _tokens(client, "a1", prompt)[0] == want["a1"]  # (the others keep working)


def _tokens(client, model, prompt):
    """The greedy completion's token ids (vLLM's return_token_ids), and the response."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return list(r.choices[0].token_ids), r


def test_lora_modules_parse_and_refuse_clearly(tmp_path):
    assert parse_lora_module("a=/x/y") == ("a", "/x/y")
    assert parse_lora_module('{"name": "b", "path": "/p"}') == ("b", "/p")
    for bad in ("noequals", "=x", '{"name": "c"}'):
        with pytest.raises(ValueError, match="lora-modules"):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="needs --enable-lora"):
        LoraModules("base", False, [("a", str(tmp_path))])
    with pytest.raises(FileNotFoundError, match="no folder"):
        LoraModules("base", True, [("a", str(tmp_path / "none"))])
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        LoraModules("base", True, [("a", str(tmp_path))])
    with pytest.raises(ValueError, match="taken"):
        LoraModules("base", True).load("base", str(tmp_path))
