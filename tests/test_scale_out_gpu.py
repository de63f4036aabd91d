"""Scale-out on two GPUs (marked `gpu`; skipped below two): data-parallel replicas that each own
one GPU (local processes and Ray actors), and torchrun tensor parallelism over NCCL, against one
engine on one GPU. bf16 on the same kind of GPU with the same kernels: equal greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tiny_model as tm
from scale_out import ROOT, completions, deadline, mixed_params, no_children, prompts
from test_external_launcher import SCRIPT, free_port, private_network

from nanovllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

KW = dict(kvcache_block_size=256, max_model_len=1024, gpu_memory_utilization=0.3)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return tm.make_tiny_qwen3(tmp_path_factory.mktemp("dp_gpu"), hidden_size=256, num_layers=3, num_heads=8,
                              num_kv_heads=2, head_dim=64, intermediate_size=512, dtype=torch.bfloat16,
                              max_position_embeddings=2048)


@pytest.fixture(scope="module")
def one_gpu(bf16_model):
    with LLM(bf16_model, **KW) as llm:
        return completions(llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                        use_tqdm=False))


def visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [d.strip() for d in env.split(",")] if env else [str(i) for i in range(torch.cuda.device_count())]


def test_dp2_replicas_own_one_gpu_each(bf16_model, one_gpu):
    with deadline(300, "DP=2 on two GPUs"), LLM(bf16_model, data_parallel_size=2, **KW) as llm:
        assert [i["cuda_visible_devices"] for i in llm.replica_info] == visible_gpus()[:2]
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        assert completions(llm.generate(prompts(), greedy, use_tqdm=False)) == one_gpu
        outs = llm.generate(prompts() * 8, greedy, use_tqdm=False)
        assert completions(outs) == one_gpu * 8
        assert all(s.prompts > 0 and s.output_tok_s > 0 for s in llm.replica_stats)
    assert no_children()


def test_ray_dp2_on_two_gpus(bf16_model, one_gpu):
    ray = pytest.importorskip("ray")
    with deadline(60, "starting Ray"):
        ray.init(num_gpus=2, num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        with deadline(300, "DP=2 on Ray GPUs"), \
                LLM(bf16_model, data_parallel_size=2, distributed_executor_backend="ray", **KW) as llm:
            gpus = [i["cuda_visible_devices"] for i in llm.replica_info]
            assert len(set(gpus)) == 2 and all(g and "," not in g for g in gpus)  # one GPU each, not the same
            assert completions(llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                            use_tqdm=False)) == one_gpu
    finally:
        ray.shutdown()


def test_torchrun_tp2_on_two_gpus_matches_tp2(bf16_model, tmp_path):
    prefix = private_network() or []  # NCCL's bootstrap works on the loopback alone
    script = tmp_path / "tp_job.py"
    script.write_text(SCRIPT.replace("kvcache_block_size=16, num_kvcache_blocks=64",
                                     "kvcache_block_size=256, max_model_len=1024, gpu_memory_utilization=0.3"))
    out = tmp_path / "ranks"
    cmd = prefix + [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                    str(script), bf16_model, str(out), os.path.dirname(os.path.abspath(__file__))]
    job = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"ranks.{r}.json").read_text()) for r in range(2)]
    ranks[0]["score"] = None
    assert ranks[0] == ranks[1]
    with LLM(bf16_model, tensor_parallel_size=2, **KW) as tp2:
        want = completions(tp2.generate(prompts(), mixed_params(), use_tqdm=False))
    # The engine's TP=2 uses the fused all-reduce, torchrun's (one node) too: the same sums.
    assert ranks[0]["tokens"] == want
