"""After start-up, a run that uses the sampling options, prefix hits, a chunked prompt and mixed
steps compiles no Triton kernel (issue 39): a compile inside a run stalls the step, and every
open stream of a server, for a second or more. Counted from Triton's own caches of every kernel
in nanovllm.kernels, so any variant compiled on first use shows, named."""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import pytest

import nanovllm.kernels
from nanovllm import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(__file__))

from triton_caches import compiled_variants, json_without_interpreter  # noqa: E402


def triton_kernels() -> dict:
    from triton.runtime.jit import JITFunction

    found = {}
    for info in pkgutil.iter_modules(nanovllm.kernels.__path__):
        module = importlib.import_module(f"nanovllm.kernels.{info.name}")
        found.update({f"{info.name}.{n}": k for n, k in vars(module).items() if isinstance(k, JITFunction)})
    return found


def compiled(kernels: dict) -> dict[str, int]:
    """Compiled variants per kernel."""
    return {n: compiled_variants(k) for n, k in kernels.items()}


def options(i: int) -> SamplingParams:
    kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.7, top_p=0.9),
             dict(temperature=0.7, top_k=20), dict(temperature=0.7, min_p=0.05),
             dict(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02), dict(temperature=0.7, logprobs=3),
             dict(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.1), dict(temperature=0.7, n=2),
             dict(temperature=0.7, logit_bias={5: 2.0}), dict(temperature=0.0, prompt_logprobs=2),
             dict(temperature=0.9, seed=7, top_p=0.8)]
    return SamplingParams(max_tokens=24, ignore_eos=True, **kinds[i % len(kinds)])


@pytest.mark.gpu
# Prefix hits run the paged prefill kernel on either cache; FP8 weights (online) add the per-tensor
# quantizer of prefill and mixed steps and the per-row decode chain (features/quantization/fp8_chain.py).
# INT4 (dummy GPTQ): tensor-core launches at every row count (kernels/w4a16.warm_up).
@pytest.mark.parametrize("kv_cache_dtype, quantization", [("auto", None), ("fp8", None), ("fp8", "fp8"),
                                                          ("auto", "gptq")])
def test_a_run_after_start_up_compiles_no_triton_kernel(kv_cache_dtype, quantization):
    sys.path.insert(0, ROOT)
    import bench

    llm = LLM(os.path.join(ROOT, bench.DUMMY_CONFIGS["qwen3-0.6b"]), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=1024, mixed_steps=True,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    try:
        kernels = triton_kernels()
        before = compiled(kernels)
        assert sum(before.values()) > 0  # (start-up compiled the model's kernels: the count sees them)
        prefix = list(range(100, 400))
        prompts = [prefix + [7 + i] * (20 + 37 * i) for i in range(24)] + [list(range(500, 1900))]
        outs = llm.generate(prompts, [options(i) for i in range(len(prompts))], use_tqdm=False)
        assert len(outs) == len(prompts)
        after = compiled(kernels)
    finally:
        llm.shutdown()
    new = {n: after[n] - before[n] for n in after if after[n] != before[n]}
    assert not new, f"compiled inside the run: {new}"


_WARM_UP_COVERS = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from triton_caches import compile_keys
from nanovllm.kernels.paged_decode import paged_decode_attention
from nanovllm.model.attention import Attention
from nanovllm.model.attention.triton_backend import TritonBackend
layer = Attention(16, 128, 128 ** -0.5, 8)
layer.k_cache, layer.v_cache = (torch.zeros(4, int(sys.argv[2]), 8, 128, dtype=torch.bfloat16) for _ in range(2))
warm = compile_keys(lambda: TritonBackend.warm_up(layer, torch.bfloat16))
q, lens = torch.zeros(3, 16, 128, dtype=torch.bfloat16), torch.ones(8, dtype=torch.int32)
run = set()
for width in range(1, 81):
    tables = torch.zeros(8, width, dtype=torch.int32)
    for splits in (1, 2, 3, 4, 5, 16, 17, 32, 48):
        for p in range(5):  # a mixed step's decode rows: the rows after its p prefill sequences
            table, ctx = tables[p:p + 3], lens[p:p + 3]
            run |= compile_keys(lambda: paged_decode_attention(q, layer.k_cache, layer.v_cache, table, ctx, 0.1,
                                                               splits))
split = {k for k in run if k[0] == "_paged_decode_split_kernel"}
print(json.dumps({"run": sorted(map(list, split)), "missing": sorted(map(list, split - warm))}))
"""


@pytest.mark.parametrize("block_size", [16, 256])
def test_the_backends_warm_up_compiles_every_decode_variant_of_mixed_steps(block_size):
    """A mixed step's decode rows launch the paged decode kernel with the step's table width (its
    longest sequence's blocks: 1 for contexts within a block), the split count for it, and its
    block tables and context lengths from the rows after the prefill ones (addresses not 16-byte
    aligned unless 4 divides them, which Triton specializes on unless told not to); decode graphs
    compile only the full width. The Triton backend's warm-up covers them all: the split
    kernel's compile keys of launches over widths 1-80, split counts 1-48 and 0-4 prefill rows
    before them are among the warm-up's, for blocks of 16 and 256 (paged_decode takes no more
    splits than a table holds tiles, so the warm-up's tables are wide enough for 16). The merge
    kernel's variants (one a power of two of splits) compile with the decode graphs. Launches
    caught, not run, in a process without the interpreter (tests/triton_caches.py)."""
    keys = json_without_interpreter(_WARM_UP_COVERS, str(block_size))
    assert len(keys["run"]) >= 3 and not keys["missing"], keys["missing"]


_INT4_WARM_UP_COVERS = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from triton_caches import compile_keys
from nanovllm.kernels.w4a16 import DEQUANT_MIN_M, w4a16_matmul, warm_up
warm, run = set(), set()
for k, n, group in ((4096, 6144, 128), (4096, 24576, 128), (12288, 4096, 128), (1024, 3072, 32), (512, 1000, 128)):
    w = (torch.zeros(k // 8, n, dtype=torch.int32), torch.ones(k // group, n).to(torch.bfloat16),
         torch.ones(k // group, n).to(torch.bfloat16), group)
    warm |= compile_keys(lambda: warm_up(*w, torch.bfloat16))
    for m in range(2, DEQUANT_MIN_M):
        run |= compile_keys(lambda: w4a16_matmul(torch.zeros(m, k, dtype=torch.bfloat16), *w))
print(json.dumps({"run": sorted(map(list, run)), "missing": sorted(map(list, run - warm))}))
"""


def test_the_int4_warm_up_compiles_every_tensor_core_launch_of_2_to_511_rows():
    """INT4 layers (features/quantization/int4.py) compile their tensor-core launches at load
    (kernels/w4a16.warm_up, one row count a range of `choose`); decode graphs compile only their
    batch sizes', and mixed and prefill steps run any row count. The compile keys of every launch
    of 2 to DEQUANT_MIN_M - 1 rows on Qwen3-8B's four shapes, a group-32 one and one of N = 1000
    (rows x N, a split's stride, a multiple of 16 only for even rows) are among the warm-up's (M
    is not specialized, so one variant serves a range). Launches caught, not run."""
    keys = json_without_interpreter(_INT4_WARM_UP_COVERS)
    assert len(keys["run"]) >= 8 and not keys["missing"], keys["missing"]
