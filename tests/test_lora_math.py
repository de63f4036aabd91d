"""LoRA groundwork (features/lora/): a PEFT adapter folder read and checked, and the batched
per-token update of a packed layer, against PEFT itself on a tiny random Qwen3 (float32): each
projection's update equals what PEFT's LoRA module adds to its base layer, for tokens of two
adapters and of none in one batch, also for one tensor-parallel rank's shard."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402

peft = pytest.importorskip("peft")

from nanovllm.features.lora.adapter import TARGETS, load_adapter  # noqa: E402
from nanovllm.features.lora.stacks import LoraStack  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROJECTIONS = list(TARGETS)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tm.make_tiny_qwen3(tmp_path_factory.mktemp("lora_base"), num_layers=2, seed=21)


def make_adapter(base: str, folder, r: int, alpha: int, seed: int, rslora=False, targets=PROJECTIONS, **extra):
    """A random PEFT LoRA adapter of `base`, saved in `folder`; returns the PEFT model too."""
    torch.manual_seed(seed)
    model = tm.load_hf_model(base)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                             use_rslora=rslora, **extra)
    pm = peft.get_peft_model(model, config)
    pm.save_pretrained(str(folder))
    return pm


def peft_update(pm, layer: int, proj: str, x: torch.Tensor) -> torch.Tensor:
    """What PEFT's LoRA module adds to its base layer's output for x."""
    block = pm.base_model.model.model.layers[layer]
    module = getattr(block.self_attn if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, proj)
    with torch.no_grad():
        return module(x) - module.base_layer(x)


def packed(adapter, layer: int, name: str) -> list:
    return [adapter.weights.get((layer, p)) for p, (ours, _) in TARGETS.items() if ours == name]


@pytest.mark.parametrize("rslora", [False, True])
def test_batched_update_equals_peft_for_every_projection(base, tmp_path, rslora):
    """Slot 0 holds adapter 1 (r 4), slot 2 adapter 2 (r 8, another alpha); tokens of slot 0,
    slot 2 and none in one batch. fp32, sums of ~100 products: within 1e-5."""
    pm1 = make_adapter(base, tmp_path / "a1", 4, 8, seed=1, rslora=rslora)
    pm2 = make_adapter(base, tmp_path / "a2", 8, 4, seed=2, rslora=rslora)
    a1, a2 = (load_adapter(n, str(tmp_path / n), 8, 2) for n in ("a1", "a2"))
    assert a1.rank == 4 and a2.rank == 8
    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor([0, 2, -1, 0, 2, 2])
    onehot = torch.nn.functional.one_hot(slots.clamp(min=0), 3).float() * (slots >= 0)[:, None]
    hf = tm.load_hf_model(base)
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        projs = [p for p, (ours, _) in TARGETS.items() if ours == name]
        sizes = [getattr(hf.model.layers[1].self_attn if p in ("q_proj", "k_proj", "v_proj", "o_proj")
                         else hf.model.layers[1].mlp, p).weight.shape[0] for p in projs]
        in_f = a1.weights[(1, projs[0])].a.shape[1]
        stack = LoraStack(3, 8, in_f, sizes, None, 0, 1, torch.float32, "cpu")
        stack.set(0, packed(a1, 1, name))
        stack.set(2, packed(a2, 1, name))
        x = torch.randn(6, in_f, generator=gen)
        got = stack.delta(x, onehot)
        for i, s in enumerate(slots.tolist()):
            want = torch.zeros(sum(sizes)) if s < 0 else torch.cat(
                [peft_update(pm1 if s == 0 else pm2, 1, p, x[i:i + 1])[0] for p in projs])
            assert torch.allclose(got[i], want, atol=1e-5, rtol=1e-4), (name, i, (got[i] - want).abs().max())


def test_tensor_parallel_shards_add_up(base, tmp_path):
    """Column-parallel ranks' updates concatenate, row-parallel ranks' updates sum, to one rank's."""
    make_adapter(base, tmp_path / "a", 4, 16, seed=5)
    a = load_adapter("a", str(tmp_path / "a"), 8, 2)
    x = torch.randn(3, 64)
    onehot = torch.ones(3, 1)
    whole = LoraStack(1, 8, 64, [128, 128], None, 0, 1, torch.float32, "cpu")
    whole.set(0, packed(a, 0, "gate_up_proj"))
    ranks = [LoraStack(1, 8, 64, [64, 64], 0, r, 2, torch.float32, "cpu") for r in range(2)]
    for s in ranks:
        s.set(0, packed(a, 0, "gate_up_proj"))
    full, parts = whole.delta(x, onehot), [s.delta(x, onehot) for s in ranks]
    gate = torch.cat([p[:, :64] for p in parts], 1)
    up = torch.cat([p[:, 64:] for p in parts], 1)
    assert torch.allclose(torch.cat([gate, up], 1), full, atol=1e-6)
    down = LoraStack(1, 8, 128, [64], None, 0, 1, torch.float32, "cpu")
    down.set(0, packed(a, 0, "down_proj"))
    halves = [LoraStack(1, 8, 64, [64], 1, r, 2, torch.float32, "cpu") for r in range(2)]
    for h in halves:
        h.set(0, packed(a, 0, "down_proj"))
    xi = torch.randn(3, 128)
    summed = halves[0].delta(xi[:, :64], onehot) + halves[1].delta(xi[:, 64:], onehot)
    assert torch.allclose(summed, down.delta(xi, onehot), atol=1e-5)


def test_adapters_that_do_not_fit_are_refused_naming_why(base, tmp_path):
    make_adapter(base, tmp_path / "big", 16, 16, seed=1)
    with pytest.raises(ValueError, match="max_lora_rank=8"):
        load_adapter("big", str(tmp_path / "big"), 8, 2)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter("none", str(tmp_path / "missing"), 8, 2)
    make_adapter(base, tmp_path / "dora", 4, 8, seed=1, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        load_adapter("dora", str(tmp_path / "dora"), 8, 2)
    make_adapter(base, tmp_path / "ok", 4, 8, seed=1)
    with pytest.raises(ValueError, match="the model has 1"):
        load_adapter("ok", str(tmp_path / "ok"), 8, 1)
    config = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    config["bias"] = "all"
    (tmp_path / "ok" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="biases"):
        load_adapter("ok", str(tmp_path / "ok"), 8, 2)
