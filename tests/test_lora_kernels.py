"""The LoRA shrink / expand kernels (kernels/lora.py) against the plain-torch product of the
adapter slots (features/lora/stacks.py, itself checked against PEFT in test_lora_math.py): fresh
random weights, tokens and slots each run (some tokens of no adapter, uneven runs per slot, a
slot longer than a tile). Under Triton's interpreter on CPU, compiled on the H200.

Bounds: in float32 the two differ only by summation order (split-K atomics in the shrink):
relative 1e-5 of the update's scale. In 16 bits both round x @ A^T and the update once; a
different fp32 summation order can flip one rounding of xa (2^-8 relative in bf16), which B then
carries, and y + update rounds once more: 2e-2 of the update's scale. Rows of no adapter must
come back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm.features.lora.stacks import LoraStack
from nanovllm.kernels.lora import BLOCK_M, LoraTiles, lora_expand, lora_shrink

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(dtype, tokens, slots=3, rank=8, parts=(40, 8, 8), in_features=72, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ())))
    stack = LoraStack(slots, rank, in_features, list(parts), None, 0, 1, torch.float32, "cpu")
    stack.a.copy_(torch.randn(stack.a.shape, generator=g))
    stack.b.copy_(torch.randn(stack.b.shape, generator=g) * (torch.rand(stack.b.shape, generator=g) < 0.5))
    token_slots = torch.randint(-1, slots, (tokens,), generator=g)
    x = torch.randn(tokens, in_features, generator=g)
    y = torch.randn(tokens, sum(parts), generator=g)
    return stack, token_slots, x, y


# (Triton's interpreter multiplies bf16 tiles wrongly: 16-bit runs there in fp16, bf16 on the GPU.)
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.mark.parametrize("dtype,tokens", [(torch.float32, 1), (torch.float32, 45), (HALF, 37), (HALF, 300)])
def test_shrink_then_expand_equal_the_slot_product(dtype, tokens):
    stack, token_slots, x, y = _case(dtype, tokens)
    if tokens > 1:
        token_slots[:BLOCK_M + 3] = 1  # one slot's run spans two tiles
    onehot = torch.zeros(tokens, stack.slots)
    rows = token_slots >= 0
    onehot[rows.nonzero().squeeze(1), token_slots[rows]] = 1.0
    a, b = stack.a.to(dtype), stack.b.to(dtype)
    x, y = x.to(dtype), y.to(dtype)
    ref = stack.delta(x.float(), onehot) if dtype == torch.float32 else None
    if ref is None:  # 16-bit: the same rounding points as LoraStack.delta on bf16 tensors
        stack.a, stack.b = a, b
        ref = stack.delta(x, onehot).float()
    want = y.float() + ref

    tiles = LoraTiles.allocate(512, stack.slots, DEVICE)
    tiles.order.fill_(-7)  # poisoned: only the planned prefix may be read
    tiles.table.fill_(3)  # (a stale plan: load must reset every tile)
    order, table = LoraTiles.plan(token_slots.numpy(), tiles.table.shape[1])
    tiles.write(torch.from_numpy(np.concatenate([order, table.ravel()])).to(DEVICE), len(order))
    width = a.shape[0] // stack.slots
    y_dev = y.to(DEVICE)
    xa = lora_shrink(x.to(DEVICE), a.to(DEVICE).view(stack.slots, width, -1), tiles)
    lora_expand(xa, b.to(DEVICE), y_dev, tiles)
    got = y_dev.cpu()
    scale = ref.abs().max().clamp(min=1.0)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.equal(got[~rows], y[~rows])
    assert ((got.float() - want).abs().max() / scale).item() <= bound


def test_the_plan_covers_every_token_of_a_slot_once():
    rng = np.random.default_rng()
    token_slots = rng.integers(-1, 5, size=200)
    capacity = -(-200 // BLOCK_M) + 5
    order, tiles = LoraTiles.plan(token_slots, capacity)
    assert sorted(order.tolist()) == np.flatnonzero(token_slots >= 0).tolist()
    seen = []
    for slot, start, count in tiles.T:
        assert 0 <= count <= BLOCK_M
        for i in order[start:start + count]:
            assert token_slots[i] == slot
            seen.append(int(i))
    assert sorted(seen) == sorted(order.tolist())
