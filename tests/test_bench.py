"""bench.py: the workload is nano-vllm's, the floor formula counts what it says, and the script
runs end to end (on a tiny checkpoint here; real numbers come from the H200)."""

import json
import os
import random
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
    # The H200's bandwidth asked for: off CUDA a run has no floors unless given one.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--model", path, "--num-seqs", "3",
                           "--max-input-len", "120", "--max-output-len", "104", "--block-size", "16",
                           "--latency", "--profile", "--profile-tokens", "3", "--profile-fresh-prompts", "--json", str(out),
                           "--bandwidth", str(bench.H200_COPY_BANDWIDTH)],
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
    # The per-step floor, rebuilt from the timeline: per group, and never below the memory floor.
    assert res["step_floor_s"] >= res["floor_s"] and 0 <= res["fraction_of_step_floor"] <= 1
    assert res["step_floor_s"] == pytest.approx(res["step_floor_prefill_s"] + res["step_floor_decode_s"], abs=2e-3)
    assert all("floor_s" in g for g in groups.values()) and groups["launch"]["floor_s"] == 0
    assert res["peak_flops"] == res["peak_flops_linear"] == bench.H200_PEAK_BF16  # bf16 weights
    kv = res["kv_usage"]["summary"]
    assert kv["running_peak"] == 3 and kv["steps"] == sum(g["steps"] for g in groups.values())
    assert 0 < kv["live_tokens_peak"] <= kv["allocated_tokens_peak"] <= kv["capacity_tokens"]
    assert kv["live_tokens_peak"] <= sum(map(len, prompts)) + sum(max_tokens)
    assert kv["static_batching_tokens"] == 3 * (max(map(len, prompts)) + max(max_tokens))
    assert len(res["kv_usage"]["series"]["t_s"]) == kv["steps"]  # (fewer than 1000: every step)


def test_bench_runs_small_settings_on_a_small_vocabulary_on_the_cpu(tmp_path):
    """Before: --max-input-len / --max-output-len below 100 crashed (randrange(100, 41)), token
    ids up to 10000 were outside a smaller vocabulary, a CPU run printed the H200's floors
    (0.0%), and a slow run printed nothing for minutes. Now: a short run within the vocabulary,
    no floors off CUDA, and its phases on stderr."""
    path = tm.make_tiny_qwen3(tmp_path / "ckpt")  # the tokenizer's vocabulary: a few hundred ids
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    assert vocab < 10_000
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--model", path, "--num-seqs", "3",
                           "--max-input-len", "40", "--max-output-len", "8", "--block-size", "16",
                           "--profile", "--profile-tokens", "2", "--profile-fresh-prompts", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    prompts, max_tokens = bench.workload(3, 40, 8, max_id=bench.workload_max_id(vocab))
    assert res["output_tokens"] == sum(max_tokens) and max(map(max, prompts)) < vocab
    assert not [k for k in res if "floor" in k] and "floor" not in proc.stdout.lower()
    assert all("floor" not in g for g in res["timeline"]) and res["kv_usage"]["summary"]["steps"] > 0
    assert "bench: timed run: 3 requests, %d output tokens" % sum(max_tokens) in proc.stderr
    assert "bench: loading" in proc.stderr and "bench: profiled run" in proc.stderr


def test_workload_of_small_settings():
    prompts, max_tokens = bench.workload(50, 40, 8, max_id=99)
    assert all(1 <= len(p) <= 40 for p in prompts) and all(1 <= n <= 8 for n in max_tokens)
    assert all(0 <= t <= 99 for p in prompts for t in p) and max(map(max, prompts)) == 99
    assert bench.workload(50, 150, 120)[1] == bench.workload(50, 150, 120, 100, 100)[1]  # >= 100: as before
    assert bench.workload_max_id(151_936) == 10_000 and bench.workload_max_id(512) == 511
    with pytest.raises(ValueError, match="max_input_len"):
        bench.workload(3, 0, 8)


def test_progress_prints_at_most_every_interval():
    import io

    from nanovllm.core.step_timing import StepTiming

    out = io.StringIO()
    progress = bench.Progress("timed run", interval_s=10.0, out=out)
    start = progress.started
    for i, at in enumerate([1, 5, 10.5, 12, 19, 21, 40]):
        progress(StepTiming(False, 4, 0.0, start + at))
    lines = out.getvalue().splitlines()
    assert lines == ["timed run: 10 s, 3 steps, 12 tokens computed", "timed run: 21 s, 6 steps, 24 tokens computed",
                     "timed run: 40 s, 7 steps, 28 tokens computed"]


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

    from nanovllm.core.step_timing import StepTiming

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


# ----------------------------------------------------------------------------- the per-step floor
PEAK, BW = 790e12, 4.3e12


def _step(is_prefill, num_tokens, num_seqs, context_tokens, attention_pairs):
    from nanovllm.core.step_timing import StepTiming

    return StepTiming(is_prefill, num_tokens, 0.0, 0.0, num_seqs, context_tokens, attention_pairs)


def _floor(name, steps, **kw):
    cfg = load_hf_config(os.path.join(ROOT, bench.DUMMY_CONFIGS[name]))
    return bench.step_floor(cfg, steps, 2, BW, PEAK, **kw)


# Qwen3-0.6B by hand: per layer q/k/v + o + gate/up/down weights, norms (2 x 1024 + q/k 2 x 128).
QWEN3_06B_LINEARS = 1024 * 4096 + 2048 * 1024 + 3 * 1024 * 3072  # 15,728,640
QWEN3_06B_PARAMS = 28 * (QWEN3_06B_LINEARS + 2304) + 151936 * 1024 + 1024  # tied embedding: 596,049,920
QWEN3_06B_KV_TOKEN = 2 * 28 * 8 * 128 * 2  # bytes


def test_step_floor_of_a_compute_bound_prefill():
    """One fresh 4096-token prompt: every projection and the attention are compute-bound
    (4096 FLOP per weight byte, far above 790e12 / 4.3e12 = 184); the LM head of its one
    sampled row is weight-bound."""
    pairs = 4096 * 4097 // 2
    step = _step(True, 4096, 1, 4096, pairs)
    gemms = 2 * 4096 * QWEN3_06B_LINEARS * 28 / PEAK
    attention = 4 * pairs * 16 * 128 * 28 / PEAK
    assert 4 * pairs * 16 * 128 * 28 / PEAK > 10 * 4096 * QWEN3_06B_KV_TOKEN / BW
    lm_head = 151936 * 1024 * 2 / BW
    norms_and_sampling = ((28 * 2304 + 1024) * 2 + 151936 * 2) / BW
    expected = gemms + attention + lm_head + norms_and_sampling
    got = _floor("qwen3-0.6b", [step])
    assert got.decode_s == 0 and got.prefill_s == pytest.approx(expected, rel=1e-12)
    assert got.total_s > 5 * QWEN3_06B_PARAMS * 2 / BW  # far above reading the weights
    # FP8 projections at twice the peak: their compute term halves, nothing else moves.
    fp8 = _floor("qwen3-0.6b", [step], linear_bytes=1, linear_peak_flops=2 * PEAK)
    assert fp8.prefill_s == pytest.approx(expected - gemms / 2, rel=1e-12)


def test_step_floor_of_a_weight_bound_decode_step():
    """4 requests of 1000 context tokens in all: every GEMM reads its weights at 4 FLOP per
    byte, so the step is bytes alone: the weights, the K/V and the logits read once."""
    step = _step(False, 4, 4, 1000, 1000)
    expected = (QWEN3_06B_PARAMS * 2 + 1000 * QWEN3_06B_KV_TOKEN + 4 * 151936 * 2) / BW
    got = _floor("qwen3-0.6b", [step, _step(False, 0, 0, 0, 0)])  # (a launch-only entry adds nothing)
    assert got.prefill_s == 0 and got.decode_s == pytest.approx(expected, rel=1e-12)
    # FP8 weights and cache: one byte per projection weight and per cached element.
    fp8 = _floor("qwen3-0.6b", [step], linear_bytes=1, kv_bytes=1, linear_peak_flops=2 * PEAK)
    assert fp8.decode_s == pytest.approx(expected - (28 * QWEN3_06B_LINEARS + 500 * QWEN3_06B_KV_TOKEN) / BW,
                                         rel=1e-12)


def test_step_floor_of_moe_steps():
    """Qwen3-30B-A3B (48 MoE layers of 128 experts, top 8, 768 wide; untied embedding)."""
    attn = 2048 * 5120 + 4096 * 2048  # qkv + o
    norms, router, expert = 2 * 2048 + 2 * 128, 128 * 2048, 3 * 2048 * 768
    kv_token = 2 * 48 * 4 * 128 * 2
    # Decode, one request: exactly its 8 experts are read, everything weight-bound.
    params = 48 * (attn + norms + router + 8 * expert) + 2 * 151936 * 2048 + 2048
    got = _floor("qwen3-30b-a3b", [_step(False, 1, 1, 1000, 1000)])
    assert got.decode_s == pytest.approx((params * 2 + 1000 * kv_token + 151936 * 2) / BW, rel=1e-12)
    # Prefill of 16 fresh 1024-token prompts: each token goes through 8 experts (compute), the
    # projections, router and attention are compute-bound, the LM head (16 rows) is not.
    pairs = 16 * 1024 * 1025 // 2
    flops = 48 * (2 * 16384 * (attn + router + 8 * expert) + 4 * pairs * 32 * 128)
    bytes_ = 151936 * 2048 * 2 + (48 * norms + 2048 + 151936 * 2048) * 2 + 16 * 151936 * 2
    got = _floor("qwen3-30b-a3b", [_step(True, 16384, 16, 16384, pairs)])
    assert got.prefill_s == pytest.approx(flops / PEAK + bytes_ / BW, rel=1e-9)  # (all 128 experts to 1e-400)


def _memory_share(opts, step, kv_bytes=2, linear_bytes=2):
    """What roofline_floor charges for the same step: a decode step reads the weights (the
    experts its batch routes to) and its context's K/V; a prefill its prompts' K/V."""
    kv = 2 * opts.num_layers * opts.num_kv_heads * opts.head_dim * kv_bytes * step.context_tokens
    if step.is_prefill or step.num_tokens == 0:
        return kv / BW
    experts = None
    if opts.moe_layers:
        experts = bench.expected_distinct_experts(opts.moe.num_experts, opts.moe.top_k, step.num_tokens)
    return (bench.weight_bytes_per_step(opts, 2, experts, linear_bytes) + kv) / BW


@pytest.mark.parametrize("name", sorted(bench.DUMMY_CONFIGS))
def test_step_floor_is_never_below_the_memory_floor(name, fresh_seed):
    rng = random.Random(fresh_seed)
    cfg = load_hf_config(os.path.join(ROOT, bench.DUMMY_CONFIGS[name]))
    opts = bench.decoder_options(cfg)
    for _ in range(200):
        kv_bytes, lin = rng.choice([(2, 2), (1, 2), (1, 1), (2, 1 + 4 / 128 ** 2)])
        if rng.random() < 0.5:
            b = rng.randint(1, 512)
            context = sum(rng.randint(1, 4096) for _ in range(b))
            step = _step(False, b, b, context, context)
        else:
            lens = [rng.randint(1, 4096) for _ in range(rng.randint(1, 16))]
            cached = [rng.randint(0, 2048) for _ in lens]
            step = _step(True, sum(lens), len(lens), sum(lens) + sum(cached),
                         sum(n * c + n * (n + 1) // 2 for n, c in zip(lens, cached)))
        got = bench.step_seconds(opts, step, 2, BW, PEAK, kv_bytes, lin, 2 * PEAK)
        assert got >= _memory_share(opts, step, kv_bytes, lin) * (1 - 1e-12)
    # The bench workload run as the memory floor pictures it (prefill in 16k-token chunks,
    # then everyone decodes side by side): the per-step floor is at or above the memory floor.
    prompts, max_tokens = bench.workload()
    steps, chunk = [], []  # chunk: (new tokens, cached tokens) of each prompt piece of the step being filled

    def flush():
        steps.append(_step(True, sum(n for n, _ in chunk), len(chunk), sum(n + c for n, c in chunk),
                           sum(n * c + n * (n + 1) // 2 for n, c in chunk)))
        chunk.clear()

    for p in map(len, prompts):
        done = 0
        while done < p:
            take = min(p - done, 16384 - sum(n for n, _ in chunk))
            chunk.append((take, done))
            done += take
            if sum(n for n, _ in chunk) == 16384:
                flush()
    flush()
    for j in range(1, max(max_tokens)):
        rows = [len(p) + j for p, n in zip(prompts, max_tokens) if n > j]
        steps.append(_step(False, len(rows), len(rows), sum(rows), sum(rows)))
    memory = bench.roofline_floor(cfg, prompts, max_tokens, 2, BW)
    assert bench.step_floor(cfg, steps, 2, BW, PEAK).total_s >= memory


def test_timeline_floors_by_group_add_up_to_the_step_floor():
    class Engine:
        step_observers: list = []

        def kv_usage(self):
            return "sampled"

    llm = Engine()
    steps = [_step(True, 0, 0, 0, 0), _step(True, 300, 2, 300, 2 * (150 * 151 // 2)),
             _step(False, 256, 256, 200_000, 200_000), _step(False, 7, 7, 7000, 7000)]
    with bench.StepTimeline(llm, kv_usage=True) as timeline:
        for s in steps:
            llm.step_observers[0](s)
    assert timeline.timings == steps and [u for _, u in timeline.kv] == ["sampled"] * 4
    cfg = load_hf_config(os.path.join(ROOT, bench.DUMMY_CONFIGS["qwen3-8b"]))
    groups = timeline.floors_by_group(cfg, 2, BW, PEAK)
    assert set(groups) == {"launch", "prefill", "decode bs>=192", "decode bs>=1"} and groups["launch"] == 0
    total = bench.step_floor(cfg, steps, 2, BW, PEAK)
    assert sum(groups.values()) == pytest.approx(total.total_s) and groups["prefill"] == pytest.approx(total.prefill_s)
    rows = {r["group"]: r for r in timeline.summary(groups)}
    assert rows["decode bs>=1"]["floor_s"] == round(groups["decode bs>=1"], 4)
    assert "of floor" in timeline.table(groups) and "of floor" not in timeline.table()


def test_static_batching_reservation():
    prompts = [[0] * 10, [0] * 20, [0] * 5]
    assert bench.static_batching_reservation(prompts, [3, 7, 100], 2) == max(2 * (20 + 7), 1 * (5 + 100))
    assert bench.static_batching_reservation(prompts, [3, 7, 100], 3) == 3 * (20 + 100)
    with pytest.raises(ValueError, match="batch_size"):
        bench.static_batching_reservation(prompts, [3, 7, 100], 0)


def test_kv_usage_report_summarises_and_thins_the_samples():
    from nanovllm.core.kv_usage import KVUsage

    # 2500 steps: live tokens rise 0..2499 with blocks of 16 allocated to cover them (+1 block).
    samples = [(100.0 + i / 1000, KVUsage(16, 1000, i // 16 + 1, i, min(i, 7))) for i in range(2500)]
    rep = bench.kv_usage_report(samples, 100.0, [[0] * 10, [0] * 20], [5, 30], batch_size=1)
    s = rep["summary"]
    assert s["steps"] == 2500 and s["capacity_tokens"] == 16000 and s["block_size"] == 16
    assert s["live_tokens_peak"] == 2499 and s["live_tokens_mean"] == pytest.approx(1249.5)
    allocated = [(i // 16 + 1) * 16 for i in range(2500)]
    assert s["allocated_tokens_peak"] == 2512 and s["allocated_tokens_mean"] == pytest.approx(sum(allocated) / 2500, abs=0.05)
    frag = [a - i for i, a in enumerate(allocated)]
    assert s["fragmentation_tokens_peak"] == 16 and 1 <= min(frag) and max(frag) <= 16
    assert s["fragmentation_of_allocated"] == pytest.approx(sum(frag) / sum(allocated), abs=1e-4)
    assert s["running_peak"] == 7
    assert s["static_batching_tokens"] == max(10 + 5, 20 + 30)
    assert s["static_over_paged_peak"] == round(50 / 2512, 3)
    series = rep["series"]
    assert len(series["t_s"]) <= 1000 and series["t_s"][0] == 0 and series["live_tokens"][0] == 0
    assert all(len(v) == len(series["t_s"]) for v in series.values())
    assert series["t_s"] == sorted(series["t_s"]) and series["t_s"][-1] > 2.0
    assert bench.kv_usage_report([], 0.0, [], [], 1) == {}


def test_plot_kv_usage_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from nanovllm.core.kv_usage import KVUsage

    samples = [(i / 10, KVUsage(16, 64, i // 4 + 1, 4 * i, 3)) for i in range(40)]
    res = {"model": "tiny", "kv_usage": bench.kv_usage_report(samples, 0.0, [[0] * 30] * 3, [20] * 3, 3)}
    (tmp_path / "bench.json").write_text(json.dumps(res))
    out = tmp_path / "kv.png"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plot_kv_usage.py"),
                           str(tmp_path / "bench.json"), str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    from benchmarks.plot_kv_usage import plot_kv_usage

    with pytest.raises(ValueError, match="kv_usage"):
        plot_kv_usage({"model": "old"}, str(tmp_path / "x.png"))


def test_mixed_step_bench_runs_on_a_tiny_checkpoint(tmp_path):
    """benchmarks/bench_mixed_step.py on the CPU (no graphs: one variant): every timing is there
    and positive, the launch within the time until the device is done."""
    path = tm.make_tiny_qwen3(tmp_path / "ckpt", vocab_size=10_001)
    out = tmp_path / "mixed.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_mixed_step.py"), "--model", path,
                           "--rows", "3", "--prompt-tokens", "20", "--context", "12", "--arrivals", "2", "--rounds", "2",
                           "--server-args", "--device cpu --max-model-len 256", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert list(report["variants"]) == ["as configured"]
    (v,) = report["variants"].values()
    assert v["n"] == 4 and 0 < v["launch_ms"] <= v["until_done_ms"] and v["mixed_and_next_ms"] > 0


def test_decode_step_bench_runs_on_a_tiny_checkpoint(tmp_path):
    """benchmarks/bench_decode_step.py: every batch size gets a timed row against its byte floor."""
    path = tm.make_tiny_qwen3(tmp_path / "ckpt", vocab_size=10_001)
    out = tmp_path / "steps.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_decode_step.py"), "--model", path,
                           "--sizes", "2,3", "--context", "20", "--steps", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [2, 3]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["floor_ms"] > 0 and 0 < r["of_floor"] <= 1
        # tok_s agrees with ms_per_step up to their roundings (ms to 1 us, tok/s to a whole
        # token), whatever the machine's speed: a slow step's tok_s rounds to a few tokens.
        fastest, slowest = r["ms_per_step"] - 5e-4, r["ms_per_step"] + 5e-4
        assert r["batch"] / slowest * 1e3 - 0.5 <= r["tok_s"] <= r["batch"] / max(fastest, 1e-9) * 1e3 + 0.5
    assert rows[1]["floor_ms"] >= rows[0]["floor_ms"]  # one more row's K/V to read (tiny: equal at 1 us)
