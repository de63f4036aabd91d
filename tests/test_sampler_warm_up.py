"""The sampler's start-up warm-up compiles every Triton variant its forward can launch, so no
compile stalls a step of a user's run. Checked without a GPU: the launches are caught instead
of run (tests/hopper_compile.py), and each one's compile key (the kernel, its constexprs, its
tensors' dtypes, the integer arguments Triton specializes) is compared between warm_up and
forward over many random mixes of rows, filters, suppressed tokens and dtypes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import triton_caches  # noqa: E402
from triton_caches import compile_keys  # noqa: E402

from nanovllm.core import triton_sampler as triton_mod  # noqa: E402
from nanovllm.core.sampler import SamplingTensors  # noqa: E402
from nanovllm.core.triton_sampler import TritonSampler  # noqa: E402

pytestmark = pytest.mark.skipif(triton_mod.triton is None, reason="needs Triton")
VOCAB = 3000


def random_row(rng: random.Random, vocab: int = VOCAB) -> tuple:
    greedy = rng.random() < 0.2
    return (0.0 if greedy else rng.choice([0.5, 1.0, 1.3]),
            0 if greedy or rng.random() < 0.5 else rng.choice([1, 20, vocab]),
            1.0 if greedy or rng.random() < 0.5 else rng.choice([0.5, 0.95]),
            0.0 if greedy or rng.random() < 0.6 else 0.1)


def variant_keys() -> tuple[set, set]:
    """(what warm_up compiles, what forward launches over 60 random batches), as compile keys."""
    triton_mod._use_triton = lambda x: True  # the CUDA routes, on CPU tensors
    sampler = TritonSampler()
    warmed = compile_keys(lambda: sampler.warm_up(VOCAB, {torch.bfloat16, torch.float32}, "cpu"))
    rng = random.Random(0)
    seen = set()
    for _ in range(60):
        rows = [random_row(rng) for _ in range(rng.choice([1, 3, 16, 17]))]
        t = SamplingTensors.from_lists(*map(list, zip(*rows)), [rng.randrange(100) for _ in rows],
                                       [rng.randrange(1, 50) for _ in rows], "cpu")
        x = torch.randn(len(rows), VOCAB).to(rng.choice([torch.bfloat16, torch.float32]))
        suppress = None if rng.random() < 0.5 else (torch.tensor([0]), torch.tensor([rng.randrange(VOCAB)]))
        seen |= compile_keys(lambda: sampler(x, t, suppress))
    return warmed, seen


def test_warm_up_compiles_every_variant_forward_launches():
    # In a process of its own: the launches are caught only without the interpreter (conftest's).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warmed, seen = (set(map(tuple, keys)) for keys in json.loads(proc.stdout.strip().splitlines()[-1]))
    assert {k[0] for k in seen} >= {"_gumbel_argmax_kernel", "_filter_scan_kernel", "_filter_decide_kernel"}
    assert seen <= warmed, sorted(seen - warmed)[:3]
    assert len(warmed) <= 16  # a handful of compiles at start-up, not one per mix of filters


def sampling_kernels() -> tuple:
    from nanovllm.kernels import sampling, top_p

    return sampling._gumbel_argmax_kernel, top_p._filter_scan_kernel, top_p._filter_mass_kernel, top_p._filter_decide_kernel


def compiled_variants() -> int:
    """How many variants of the sampling kernels this process has compiled (Triton's caches)."""
    return triton_caches.compiled_variants(*sampling_kernels())


@pytest.mark.gpu
def test_on_cuda_nothing_compiles_after_the_warm_up():
    """The real caches (alignment and all): after warm_up, batches of every mix compile nothing.
    The caches start empty (other GPU tests in the process compile their own variants)."""
    triton_caches.forget_compiled(*sampling_kernels())
    sampler, vocab = TritonSampler(), 151_936
    sampler.warm_up(vocab, {torch.bfloat16, torch.float32}, "cuda")
    warmed = compiled_variants()
    assert 0 < warmed <= 16
    rng = random.Random(1)
    for _ in range(30):
        rows = [random_row(rng, vocab) for _ in range(rng.choice([1, 5, 64, 200]))]
        t = SamplingTensors.from_lists(*map(list, zip(*rows)), [rng.randrange(100) for _ in rows],
                                       [rng.randrange(1, 50) for _ in rows], "cuda")
        x = torch.randn(len(rows), vocab, device="cuda").to(rng.choice([torch.bfloat16, torch.float32]))
        suppress = None if rng.random() < 0.5 else (torch.tensor([0], device="cuda"),
                                                    torch.tensor([rng.randrange(vocab)], device="cuda"))
        assert sampler(x, t, suppress).shape == (len(rows),)
    torch.cuda.synchronize()
    assert compiled_variants() == warmed


if __name__ == "__main__":
    print(json.dumps([sorted(keys) for keys in variant_keys()]))
