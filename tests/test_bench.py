"""bench.py: the workload is nano-vllm's, the floor formula counts what it says, and the script
runs end to end (on a tiny checkpoint here; real numbers come from the H200)."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import tiny_model as tm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import torch  # noqa: E402
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


def test_floor_counts_fp8_bytes():
    """An FP8 KV cache halves the KV reads; FP8 linear weights halve the decoder's GEMM weights
    (embedding, LM head and norms stay 16-bit)."""
    cfg = load_hf_config(os.path.join(ROOT, bench.DUMMY_CONFIGS["qwen3-8b"]))
    kv_only = [[0] * 1000], [1]
    base = bench.roofline_floor(cfg, *kv_only, 2, 1.0)
    assert bench.roofline_floor(cfg, *kv_only, 2, 1.0, kv_bytes=1) == base - 1000 * 2 * 36 * 8 * 128
    h, i, L, v = 4096, 12288, 36, 151936
    linears = L * (h * (32 + 16) * 128 + 32 * 128 * h + 3 * h * i)
    fp8 = bench.roofline_floor(cfg, *kv_only, 2, 1.0, kv_bytes=2, linear_bytes=1)
    assert base - fp8 == linears  # one byte less per linear weight element
    assert 2 * linears / (base - 1000 * 2 * 36 * 8 * 128) > 0.8 and 2 * v * h < base  # linears: most of the bytes


@pytest.mark.parametrize("name", sorted(bench.DUMMY_CONFIGS))
def test_weight_bytes_count_every_parameter_transformers_builds(name):
    """Per decode step every parameter is read once (all experts when the batch uses them all):
    the count from the config equals the parameters of transformers' model of that config."""
    from transformers import AutoModelForCausalLM

    cfg = load_hf_config(os.path.join(ROOT, bench.DUMMY_CONFIGS[name]))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    assert bench.weight_bytes_per_step(bench.decoder_options(cfg), 2) == 2 * params


def test_expected_distinct_experts_is_the_uniform_routing_mean():
    import itertools

    # Exhaustive: B tokens each pick one of the k-subsets of E experts, all equally likely.
    for num_experts, top_k, batch in ((4, 2, 2), (5, 2, 3), (6, 3, 2)):
        subsets = list(itertools.combinations(range(num_experts), top_k))
        sizes = [len(set().union(*choice)) for choice in itertools.product(subsets, repeat=batch)]
        assert abs(bench.expected_distinct_experts(num_experts, top_k, batch) - sum(sizes) / len(sizes)) < 1e-12
    assert bench.expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert 127.9 < bench.expected_distinct_experts(128, 8, 256) < 128


def test_moe_floor_reads_the_routed_experts_only():
    cfg = load_hf_config(os.path.join(ROOT, bench.DUMMY_CONFIGS["qwen3-30b-a3b"]))
    opts = bench.decoder_options(cfg)
    kv_per_token = 2 * 48 * 4 * 128 * 2
    expert = 3 * 2048 * 768 * 2
    # One request, one token: a batch of 1 routes to exactly top_k = 8 experts per layer.
    one = bench.roofline_floor(cfg, [[0] * 10], [1], 2, 1.0)
    assert one == pytest.approx(10 * kv_per_token + bench.weight_bytes_per_step(opts, 2, 8))
    all_experts = bench.weight_bytes_per_step(opts, 2)
    assert all_experts - bench.weight_bytes_per_step(opts, 2, 8) == 48 * 120 * expert
    # Exact counts replace the estimate (the hook), one per decode step.
    exact = bench.roofline_floor(cfg, [[0] * 10, [0] * 5], [2, 1], 2, 1.0, experts_per_step=[12, 8])
    kv = (2 * 10 + 1) * kv_per_token + 5 * kv_per_token
    assert exact == pytest.approx(kv + bench.weight_bytes_per_step(opts, 2, 12) + bench.weight_bytes_per_step(opts, 2, 8))
    estimate = bench.roofline_floor(cfg, [[0] * 10, [0] * 5], [2, 1], 2, 1.0)
    two = bench.expected_distinct_experts(128, 8, 2)  # step 0 decodes both requests, step 1 one
    assert estimate == pytest.approx(kv + bench.weight_bytes_per_step(opts, 2, two) + bench.weight_bytes_per_step(opts, 2, 8))
    with pytest.raises(ValueError, match="experts_per_step"):
        bench.roofline_floor(cfg, [[0] * 10], [3], 2, 1.0, experts_per_step=[8, 8])
    # The bench workload at 256 requests: far below reading all 128 experts only near the end.
    prompts, max_tokens = bench.workload()
    full = bench.roofline_floor(cfg, prompts, max_tokens, 2, 4.3e12, experts_per_step=[128] * max(max_tokens))
    assert bench.roofline_floor(cfg, prompts, max_tokens, 2, 4.3e12) < full


def test_bench_runs_on_a_tiny_checkpoint(tmp_path):
    path = tm.make_tiny_qwen3(tmp_path / "ckpt", vocab_size=10_001)  # the workload's ids go up to 10000
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--model", path, "--num-seqs", "3",
                           "--max-input-len", "120", "--max-output-len", "104", "--block-size", "16",
                           "--latency", "--profile", "--profile-tokens", "3", "--profile-fresh-prompts", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    prompts, max_tokens = bench.workload(3, 120, 104)
    assert res["output_tokens"] == sum(max_tokens)
    assert res["output_tok_s"] > 0 and res["seconds"] > 0
    assert 0 <= res["fraction_of_floor"] <= 1 and res["floor_s"] >= 0  # tiny model on a CPU: ~0
    assert res["decode_ms_per_token_bs1"] > 0
    assert res["profile"]["tokens"] == 3 and res["profile"]["fresh_prompts"] and res["profile"]["wall_s"] > 0
    # The timed run cached every full block of these prompts; fresh prompts miss that cache.
    assert res["profile"]["prefill_tokens"] == sum(map(len, prompts))
    assert set(res["profile"]["kernels_s"]) == {k for k, _ in bench.KERNEL_KINDS} | {"other"}
    groups = {g["group"]: g for g in res["timeline"]}
    assert groups["prefill"]["tokens"] == sum(map(len, prompts))  # one chunk each; no shared blocks
    decode = sum(g["tokens"] for name, g in groups.items() if name.startswith("decode"))
    assert decode >= sum(max_tokens) - len(prompts)  # every token after the first, plus rows of ended requests
    assert 0 < sum(g["seconds"] for g in groups.values()) <= res["seconds"] + 1e-3  # (rounded to ms)


def test_bench_logprobs_option(tmp_path):
    """--logprobs K: every timed request asks for K logprobs (the default run asks for none)."""
    path = tm.make_tiny_qwen3(tmp_path / "ckpt", vocab_size=10_001)
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--model", path, "--num-seqs", "2",
                           "--max-input-len", "110", "--max-output-len", "101", "--block-size", "16",
                           "--logprobs", "5", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["logprobs"] == 5 and res["output_tokens"] == sum(bench.workload(2, 110, 101)[1])


def test_startup_profile_names_where_the_cold_start_goes(tmp_path):
    path = tm.make_tiny_qwen3(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--model", path, "--profile-startup"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "cumulative" in proc.stdout and "model_runner.py" in proc.stdout


def test_kernel_breakdown_sorts_profiled_kernels_by_kind():
    kernels = [  # names as the H200 profiles print them
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 100.0),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", 2.0),
        ("_paged_decode_split_kernel", 50.0),
        ("_paged_decode_merge_kernel", 5.0),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 30.0),
        ("_all_reduce_rms_norm_kernel", 20.0),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", 40.0),
        ("_rms_norm_kernel", 3.0),
        ("_qk_norm_rope_kernel", 1.5),
        ("_gumbel_argmax_kernel", 7.0),
        ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128>>", 6.0),
        ("void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128>>", 1.0),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", 9.0),
        ("void at::native::vectorized_gather_kernel<16, long>(char*, char*)", 4.0),
    ]
    got = {k: round(v * 1e6, 6) for k, v in bench.kernel_breakdown(kernels).items()}
    assert got == {"fused all-reduce + norm": 20.0, "nccl": 30.0, "decode attention": 62.0,
                   "prefill attention": 49.0, "gemm": 102.0, "norm / rope / silu / kv store": 4.5,
                   "sampling": 7.0, "other": 4.0}


def test_step_timeline_groups_steps_and_counts_the_waits():
    import time

    from nanovllm.engine.lifecycle import StepTiming

    class FakeEngine:  # calls its step observers as LLMEngine.step does
        def __init__(self):
            self.script = [(0, True), (300, True), (256, False), (200, False), (7, False), (1, False)]
            self.step_observers = []

        def step(self):
            tokens, is_prefill = self.script.pop(0)
            waited = 0.0
            if tokens:  # the first step only launches: nothing to wait for
                t = time.perf_counter()
                time.sleep(0.001)  # "waits" for the device's tokens
                waited = time.perf_counter() - t
            timing = StepTiming(is_prefill, tokens, waited, time.perf_counter())
            for observer in self.step_observers:
                observer(timing)
            return [], tokens, is_prefill

    llm = FakeEngine()
    with bench.StepTimeline(llm) as timeline:
        for _ in range(6):
            llm.step()
    assert llm.step_observers == []  # no longer observed
    patched = llm.step = lambda: ([], 1, False)  # the engine's step itself is never replaced
    with bench.StepTimeline(llm):
        llm.step()
    assert llm.step is patched
    rows = {r["group"]: r for r in timeline.summary()}
    assert {k: (r["steps"], r["tokens"]) for k, r in rows.items()} == {
        "launch": (1, 0), "prefill": (1, 300), "decode bs>=192": (2, 456), "decode bs>=1": (2, 8)}
    assert rows["launch"]["waited"] == 0 and all(0 < r["waited"] <= 1 for k, r in rows.items() if k != "launch")
    assert "decode bs>=192" in timeline.table()
