"""Throughput benchmark: the nano-vllm workload, against the memory-roofline floor and a peer.

    python bench.py --dummy qwen3-0.6b            # random weights of the real shape
    python bench.py --model ~/huggingface/Qwen3-8B --compare hf
    python bench.py --dummy qwen3-8b --latency    # batch-1 decode ms/token
    python bench.py --dummy qwen3-0.6b --logprobs 5   # every request also asks for 5 logprobs
    python bench.py --dummy qwen3-30b-a3b         # also qwen2.5-7b, llama-3.1-8b
    python bench.py --dummy qwen3-0.6b --json a.json
    python benchmarks/plot_kv_usage.py a.json kv.png                     # KV-cache use over the run
    python bench.py --dummy qwen3-0.6b --dp 2     # data parallelism: 2 replicas, per-replica tok/s

Workload (nano-vllm's bench.py): random.seed(0); 256 sequences; prompt lengths randint(100, 1024)
of token ids randint(0, 10000); max_tokens randint(100, 1024); temperature 0.6; ignore_eos;
max_model_len 4096; one warm-up generate, then one timed generate of all 256 (133,966 output
tokens). Smaller settings shorten it (--max-input-len / --max-output-len below 100 lower the minimums
to them) and token ids stay below the model's vocabulary. The phases and the timed run's progress
go to stderr.

Floor: a decode step must at least read the weights once, and each generated token must read the
K/V of its whole context, so seconds >= (sum over generated tokens of context_len x KV bytes per
token + decode steps x weight bytes) / bandwidth, with decode steps = the longest request's
max_tokens (all requests decode side by side). Prefill reads are ignored (a lower bound). For MoE
models a step reads only the experts its batch routes to: estimated from the batch size under
uniform routing (see roofline_floor). The floors use the H200's bandwidth and peaks by default:
off CUDA they are left out unless --bandwidth (and --peak-flops) give the device's own.

Per-step floor (beside it, not instead: the memory floor's history stays comparable): the run's
own steps, rebuilt from its step timeline (StepTiming's shape of each step), each at its lower
bound knowing compute as well as bytes (step_seconds): every GEMM at max(FLOPs / peak, weight
bytes / bandwidth), attention at max(its FLOPs, its K/V bytes), the logits read once. It judges
prefill-heavy work and large decode batches (compute-bound GEMMs) where the memory floor cannot.

KV-cache use: after every step, live tokens against the capacity of the blocks held, and how
many requests run (LLMEngine.kv_usage), beside what static batching would reserve for the same
requests (static_batching_reservation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
DUMMY_CONFIGS = {name: f"benchmarks/configs/{name}"
                 for name in ("qwen3-0.6b", "qwen3-8b", "qwen2.5-7b", "llama-3.1-8b", "qwen3-30b-a3b")}
H200_COPY_BANDWIDTH = 4.3e12  # B/s, device-to-device copy measured on the H200


def workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024, min_input_len: int = 100,
             min_output_len: int = 100, max_id: int = 10000):
    """nano-vllm's benchmark requests: (prompt token ids, max_tokens) pairs, in its RNG order
    (the defaults are its workload; token ids 0..max_id). A maximum below its minimum lowers the
    minimum to it (short settings for small runs)."""
    if min(num_seqs, max_input_len, max_output_len) < 1 or max_id < 0:
        raise ValueError("workload: num_seqs, max_input_len and max_output_len must be >= 1, max_id >= 0")
    min_input_len, min_output_len = min(min_input_len, max_input_len), min(min_output_len, max_output_len)
    random.seed(0)
    prompts = [[random.randint(0, max_id) for _ in range(random.randint(min_input_len, max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [random.randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def workload_max_id(vocab_size: int) -> int:
    """The largest token id of the workload: nano-vllm's 10000, or below a smaller vocabulary."""
    return min(10000, vocab_size - 1)


@contextlib.contextmanager
def observing(llm, observer):
    """`observer` among the engine's step observers for the block (None: nothing)."""
    if observer is not None:
        llm.step_observers.append(observer)
    try:
        yield
    finally:
        if observer is not None:
            llm.step_observers.remove(observer)


class Progress:
    """A step observer that prints, at most every `interval_s` seconds of the run, how far it got
    (to stderr): a slow run (a CPU, a big model) shows it is alive. One clock compare per step."""

    def __init__(self, what: str, interval_s: float = 10.0, out=None):
        self.what, self.interval_s, self.out = what, interval_s, out or sys.stderr
        self.started = self._last = time.perf_counter()
        self.steps = self.tokens = 0

    def __call__(self, timing) -> None:
        self.steps += 1
        self.tokens += timing.num_tokens
        if timing.ended_at - self._last >= self.interval_s:
            self._last = timing.ended_at
            print(f"{self.what}: {timing.ended_at - self.started:.0f} s, {self.steps} steps, {self.tokens} tokens "
                  "computed", file=self.out, flush=True)


def decoder_options(hf_config):
    """The model's DecoderOptions (sizes, biases, MoE layout), as the engine builds it."""
    from nanovllm.model.registry import model_class

    return model_class(hf_config).options_from_config(hf_config)


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected number of distinct experts `batch` tokens route to when each token picks `top_k`
    of `num_experts` uniformly at random: E * (1 - (1 - k/E)^B). An ESTIMATE for a real model:
    trained routers are not uniform (popular experts make the true count smaller), and dummy
    weights route close to uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def weight_bytes_per_step(opts, dtype_bytes: int, experts_read: float | None = None,
                          linear_bytes: float | None = None) -> float:
    """Bytes of weights one decode step reads: every parameter once (the embedding too, as the
    issue's floors count it; tied embeddings are one matrix), except that each MoE layer reads
    its router and `experts_read` of its experts (all of them when None). Biases and norms
    are counted though negligible. linear_bytes: bytes per element of the decoder layers'
    projection and expert weights (FP8: 1 and their scales' share; default dtype_bytes)."""
    lin = dtype_bytes if linear_bytes is None else linear_bytes
    h, hd, nh, nkv = opts.hidden_size, opts.head_dim, opts.num_heads, opts.num_kv_heads
    attn = (h * (nh + 2 * nkv) * hd + nh * hd * h) * lin + 2 * h * dtype_bytes  # q/k/v, o, the two norms
    attn += ((nh + 2 * nkv) * hd * opts.qkv_bias + h * opts.o_bias + 2 * hd * opts.qk_norm) * dtype_bytes
    dense_mlp = 3 * h * opts.intermediate_size * lin + (2 * opts.intermediate_size + h) * opts.mlp_bias * dtype_bytes
    total = opts.num_layers * attn + (opts.num_layers - len(opts.moe_layers)) * dense_mlp
    if opts.moe_layers:
        m = opts.moe
        experts = m.num_experts if experts_read is None else experts_read
        total += len(opts.moe_layers) * (m.num_experts * h * dtype_bytes + experts * 3 * h * m.intermediate_size * lin)
    embed = opts.vocab_size * h * (1 if opts.tie_word_embeddings else 2)
    return total + (h + embed) * dtype_bytes


def roofline_floor(hf_config, prompts, max_tokens, dtype_bytes: int, bandwidth: float,
                   experts_per_step=None, kv_bytes: int | None = None, linear_bytes: float | None = None) -> float:
    """Lower bound in seconds for generating `max_tokens` after each prompt (module docstring).

    MoE models read per decode step only the experts the batch routes to. `experts_per_step`:
    the number of distinct experts read per MoE layer (averaged over the layers) at each decode
    step, e.g. counted from the routers' topk_ids; by default (None) it is estimated from the
    step's batch size under uniform random routing (expected_distinct_experts), with batch =
    the requests still decoding at that step (all decode side by side). kv_bytes: the KV
    cache's bytes per element (1 for an FP8 cache; default dtype_bytes); linear_bytes: see
    weight_bytes_per_step.
    """
    opts = decoder_options(hf_config)
    kv_per_token = 2 * opts.num_layers * opts.num_kv_heads * opts.head_dim * (kv_bytes or dtype_bytes)
    # Token j of a request (0-based) is generated from a context of prompt_len + j tokens.
    kv_reads = sum(n * p + n * (n - 1) // 2 for p, n in zip(map(len, prompts), max_tokens))
    steps = max(max_tokens)
    if not opts.moe_layers:
        weights = steps * weight_bytes_per_step(opts, dtype_bytes, linear_bytes=linear_bytes)
    else:
        if experts_per_step is None:
            m = opts.moe
            experts_per_step = [expected_distinct_experts(m.num_experts, m.top_k, sum(n > j for n in max_tokens))
                                for j in range(steps)]
        if len(experts_per_step) != steps:
            raise ValueError(f"experts_per_step has {len(experts_per_step)} entries, expected one per decode step ({steps})")
        weights = sum(weight_bytes_per_step(opts, dtype_bytes, e, linear_bytes) for e in experts_per_step)
    return (kv_reads * kv_per_token + weights) / bandwidth


def quantization_name(quant) -> str | None:
    """"fp8-block", "fp8-tensor", or the INT4 scheme's description."""
    return None if quant is None else f"fp8-{quant.scheme}" if hasattr(quant, "scheme") else str(quant)


def weight_element_bytes(llm) -> tuple[int, float]:
    """(KV cache bytes per element, decoder linear weights' bytes per element) of an engine."""
    cfg = llm.config
    quant = cfg.quant
    if quant is None:
        linear = cfg.dtype.itemsize
    elif hasattr(quant, "bytes_per_weight"):  # INT4: half a byte and the group's scale and zero point
        linear = quant.bytes_per_weight(cfg.dtype.itemsize, cfg.hf_config.hidden_size)
    elif quant.scheme == "block":
        linear = 1 + 4 / (128 * 128)  # an fp32 scale per 128x128 block
    else:
        linear = 1.0  # one scale per weight: nothing
    return cfg.kv_dtype.itemsize, linear


# ----------------------------------------------------------------------------- the per-step floor
H200_PEAK_BF16 = 790e12  # FLOP/s, dense bf16 tensor-core peak of the H200 (SXM)
H200_PEAK_FP8 = 1580e12  # FLOP/s, dense FP8


class StepFloor(NamedTuple):
    """The per-step floor of a run, in seconds, split by kind of step (step_floor)."""

    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def step_gemms(opts, rows: int, lm_rows: int, dtype_bytes: int, linear_bytes: float,
               experts_read: float | None = None) -> list[tuple[float, float, bool]]:
    """The GEMMs of one forward pass over `rows` tokens, `lm_rows` of which go through the LM
    head: (FLOPs, weight bytes, is a decoder-layer projection) each, all layers together (the
    FLOPs/byte ratio of one kind of GEMM is the same in every layer, so summing layers first
    changes no max() below). FLOPs = 2 * rows * K * N. A MoE layer's router is one GEMM and
    its experts another: every token goes through top_k experts (FLOPs), the weights of
    `experts_read` experts are read (bytes; all of them when None), as weight_bytes_per_step
    counts them. linear_bytes: bytes per element of the projection and expert weights."""
    h, hd, nh, nkv = opts.hidden_size, opts.head_dim, opts.num_heads, opts.num_kv_heads
    num_layers, num_moe = opts.num_layers, len(opts.moe_layers)
    out = []

    def gemm(m: float, k: int, n: int, layers: int, elem_bytes: float, linear: bool, matrices: float = 1.0):
        """`layers` GEMMs [m, k] x [k, n]; `matrices` weight matrices of k x n read per layer."""
        if layers:
            out.append((2.0 * m * k * n * layers, matrices * k * n * elem_bytes * layers, linear))

    gemm(rows, h, (nh + 2 * nkv) * hd, num_layers, linear_bytes, True)  # qkv
    gemm(rows, nh * hd, h, num_layers, linear_bytes, True)  # o
    # gate_up [h, 2I] and down [I, h]: as one [h, 3I] (same FLOPs and bytes)
    gemm(rows, h, 3 * opts.intermediate_size, num_layers - num_moe, linear_bytes, True)
    if num_moe:
        m = opts.moe
        experts = m.num_experts if experts_read is None else experts_read
        gemm(rows, h, m.num_experts, num_moe, dtype_bytes, False)  # router
        # Each token's top_k experts (FLOPs, as M = rows x top_k); `experts` matrices read.
        gemm(rows * m.top_k, h, 3 * m.intermediate_size, num_moe, linear_bytes, True, matrices=experts)
    gemm(lm_rows, h, opts.vocab_size, 1, dtype_bytes, False)  # LM head
    return out


def step_seconds(opts, step, dtype_bytes: int, bandwidth: float, peak_flops: float, kv_bytes: int | None = None,
                 linear_bytes: float | None = None, linear_peak_flops: float | None = None) -> float:
    """Lower bound in seconds of one engine step, knowing compute as well as memory.

    `step` has StepTiming's fields is_prefill, num_tokens, num_seqs, context_tokens and
    attention_pairs. Each GEMM (step_gemms; M = the step's tokens, num_seqs for the LM head)
    takes max(FLOPs / peak, weight bytes / bandwidth): decoder projections at
    `linear_peak_flops` (FP8 weights: ~2x; default peak_flops), the router and the LM head at
    `peak_flops`. Attention takes max(4 * attention_pairs * heads * head_dim per layer (QK^T
    and PV, 2 FLOPs a multiply-add) / peak, context_tokens x KV bytes per token / bandwidth),
    which for a prefill is the new K/V written and any cached prefix read. Sampling reads
    each row's logits once (num_seqs x vocab in the model dtype). Weights outside GEMMs (norms,
    biases, and the embedding table, counted whole as the memory floor counts it) are bytes
    alone. So a step is never below its share of the memory floor (roofline_floor): each term
    is at least its bytes / bandwidth. MoE: the experts a step reads are estimated from its
    tokens under uniform routing (expected_distinct_experts), as the memory floor does.
    """
    if step.num_tokens == 0:
        return 0.0  # the launch-only first entry of a timeline
    lin = dtype_bytes if linear_bytes is None else linear_bytes
    lin_peak = peak_flops if linear_peak_flops is None else linear_peak_flops
    experts = None
    if opts.moe_layers:
        m = opts.moe
        experts = expected_distinct_experts(m.num_experts, m.top_k, step.num_tokens)
    gemms = step_gemms(opts, step.num_tokens, step.num_seqs, dtype_bytes, lin, experts)
    seconds = sum(max(f / (lin_peak if linear else peak_flops), b / bandwidth) for f, b, linear in gemms)
    other_weights = weight_bytes_per_step(opts, dtype_bytes, experts, lin) - sum(b for _, b, _ in gemms)
    kv_per_token = 2 * opts.num_layers * opts.num_kv_heads * opts.head_dim * (kv_bytes or dtype_bytes)
    attn_flops = 4.0 * step.attention_pairs * opts.num_heads * opts.head_dim * opts.num_layers
    seconds += max(attn_flops / peak_flops, step.context_tokens * kv_per_token / bandwidth)
    sampling = step.num_seqs * opts.vocab_size * dtype_bytes
    return seconds + (other_weights + sampling) / bandwidth


def step_floor(hf_config, steps, dtype_bytes: int, bandwidth: float, peak_flops: float, kv_bytes: int | None = None,
               linear_bytes: float | None = None, linear_peak_flops: float | None = None) -> StepFloor:
    """The per-step floor of a run whose steps were `steps` (StepTiming-like, see
    step_seconds): their lower bounds summed, prefill and decode steps apart. Unlike
    roofline_floor it knows the schedule the run took (how many steps, which batch sizes,
    how much prefill) and compute, so prefill-heavy work is judged against its FLOPs."""
    opts = decoder_options(hf_config)
    parts = [0.0, 0.0]
    for step in steps:
        parts[0 if step.is_prefill else 1] += step_seconds(opts, step, dtype_bytes, bandwidth, peak_flops, kv_bytes,
                                                           linear_bytes, linear_peak_flops)
    return StepFloor(*parts)


# ----------------------------------------------------------------------------- KV-cache use


def static_batching_reservation(prompts, max_tokens, batch_size: int) -> int:
    """KV tokens static batching reserves for these requests at its peak: batches of
    `batch_size` requests in submission order, one after another, each request of a batch
    holding room for the batch's longest prompt (padding) + its largest max_tokens (a static
    batch runs until its longest request ends) for the batch's whole lifetime."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    peak = 0
    for i in range(0, len(prompts), batch_size):
        batch = range(i, min(i + batch_size, len(prompts)))
        peak = max(peak, len(batch) * (max(len(prompts[j]) for j in batch) + max(max_tokens[j] for j in batch)))
    return peak


def kv_usage_report(samples, start: float, prompts, max_tokens, batch_size: int, max_points: int = 1000) -> dict:
    """KV-cache use over a run from per-step KVUsage samples ((perf_counter time, KVUsage) pairs,
    StepTimeline(kv_usage=True).kv): a time series thinned to at most `max_points` points and
    the summary (means over steps, peaks), with static batching's reservation for the same
    requests (static_batching_reservation with `batch_size`) beside it."""
    if not samples:
        return {}
    usage = [u for _, u in samples]
    stride = -(-len(samples) // max_points)
    kept = samples[::stride]
    live = [u.live_tokens for u in usage]
    allocated = [u.allocated_tokens for u in usage]
    frag = [u.fragmentation_tokens for u in usage]
    static = static_batching_reservation(prompts, max_tokens, batch_size)
    n = len(usage)
    summary = {
        "steps": n, "block_size": usage[0].block_size, "capacity_tokens": usage[0].num_blocks * usage[0].block_size,
        "live_tokens_mean": round(sum(live) / n, 1), "live_tokens_peak": max(live),
        "allocated_tokens_mean": round(sum(allocated) / n, 1), "allocated_tokens_peak": max(allocated),
        "fragmentation_tokens_mean": round(sum(frag) / n, 1), "fragmentation_tokens_peak": max(frag),
        "fragmentation_of_allocated": round(sum(frag) / max(sum(allocated), 1), 4),
        "running_peak": max(u.running_seqs for u in usage),
        "static_batching_tokens": static,
        "static_batching": f"batches of {batch_size} requests (max_num_seqs) in submission order, each request "
                           f"reserving its batch's longest prompt + largest max_tokens for the batch's lifetime",
        "static_over_paged_peak": round(static / max(max(allocated), 1), 3),
    }
    series = {"t_s": [round(t - start, 4) for t, _ in kept], "live_tokens": [u.live_tokens for _, u in kept],
              "allocated_tokens": [u.allocated_tokens for _, u in kept], "running": [u.running_seqs for _, u in kept]}
    return {"summary": summary, "series": series}


# Kernel name fragments per kind of work, first match wins: what `--profile` sums up.
KERNEL_KINDS = (
    ("fused all-reduce + norm", ("_all_reduce_rms_norm", "_wait_count")),  # + the copy-engine wait
    ("nccl", ("nccl",)),
    ("decode attention", ("_paged_decode", "splitkv")),  # ours; flash-attn's decode kernels
    ("prefill attention", ("flash_fwd", "flash_attn", "_flash_attention", "fmha", "attention")),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "splitkreduce", "cublas")),
    ("norm / rope / silu / kv store", ("_rms_norm", "_qk_norm", "_silu", "_store_kvcache")),
    ("sampling", ("gumbel", "sampl", "argmax", "topk", "sort")),
)


def profiled_kernels(prof) -> list[tuple[str, float]]:
    """(kernel name, microseconds) of every GPU kernel a torch.profiler run recorded."""
    import torch

    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_breakdown(kernels) -> dict[str, float]:
    """Seconds of device time per kind of kernel (KERNEL_KINDS, else "other"), from
    (kernel name, microseconds) pairs."""
    out = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for name, us in kernels:
        low = name.lower()
        kind = next((k for k, frags in KERNEL_KINDS if any(f in low for f in frags)), "other")
        out[kind] += us / 1e6
    return out


class StepTimeline:
    """Where a run's wall time goes, step by step: each engine step's share (the time between
    the ends of consecutive steps) and how much of it the host spent waiting for the device's
    tokens, grouped into prefill steps and decode steps by batch size. A group whose wait is a
    small part of its time was host-bound there.

    Use as a context manager around one generate(): it is one of the engine's step observers
    (`LLMEngine.step_observers`, which get a StepTiming per step) for that long. `timings`
    keeps every StepTiming (the step's shape too: step_floor rebuilds the run's floor from
    them). With kv_usage=True it also samples `llm.kv_usage()` after every step into `kv`,
    as (time.perf_counter(), KVUsage) pairs.
    """

    BUCKETS = (192, 128, 64, 32, 16, 8, 1)  # decode groups: batch sizes >= these

    def __init__(self, llm, kv_usage: bool = False):
        self.llm = llm
        self.steps: list[tuple[bool, int, float, float]] = []  # (is prefill, tokens, seconds, waited)
        self.timings: list = []  # the StepTimings themselves
        self.kv: list = []
        self._sample_kv = kv_usage

    def __enter__(self):
        self._last = self.started = time.perf_counter()
        self.llm.step_observers.append(self._record)
        return self

    def _record(self, timing) -> None:
        self.steps.append((timing.is_prefill, timing.num_tokens, timing.ended_at - self._last, timing.wait_s))
        self.timings.append(timing)
        if self._sample_kv:
            self.kv.append((timing.ended_at, self.llm.kv_usage()))
        self._last = timing.ended_at

    def __exit__(self, *exc):
        self.llm.step_observers.remove(self._record)

    @classmethod
    def group(cls, is_prefill: bool, tokens: int) -> str:
        """The summary group of a step."""
        if tokens == 0:  # the first call only launches
            return "launch"
        if is_prefill:
            return "prefill"
        return "decode bs>=%d" % next(b for b in cls.BUCKETS if tokens >= b)

    def summary(self, floors: dict[str, float] | None = None) -> list[dict]:
        """One row per group: steps, seconds, ms per step, the waited fraction; with `floors`
        (seconds per group, e.g. floors_by_group), also the group's floor and its fraction."""
        groups: dict[str, list] = {}
        for is_prefill, tokens, secs, waited in self.steps:
            g = groups.setdefault(self.group(is_prefill, tokens), [0, 0, 0.0, 0.0])
            g[0] += 1
            g[1] += tokens
            g[2] += secs
            g[3] += waited
        rows = [{"group": k, "steps": n, "tokens": tok, "seconds": round(s, 4), "ms_per_step": round(s / n * 1e3, 3),
                 "waited": round(w / max(s, 1e-12), 3)} for k, (n, tok, s, w) in groups.items()]
        for r in rows if floors is not None else ():
            f = floors.get(r["group"], 0.0)
            r["floor_s"], r["of_floor"] = round(f, 4), round(f / max(r["seconds"], 1e-12), 3)
        return rows

    def table(self, floors: dict[str, float] | None = None) -> str:
        with_floor = floors is not None
        rows = [f"{'steps of the run':<18}{'steps':>7}{'tokens':>9}{'seconds':>9}{'ms/step':>9}{'waited':>8}"
                + (f"{'floor s':>9}{'of floor':>9}" if with_floor else "")]
        rows += [f"{r['group']:<18}{r['steps']:>7}{r['tokens']:>9}{r['seconds']:>9.3f}{r['ms_per_step']:>9.3f}"
                 f"{r['waited']:>8.0%}" + (f"{r['floor_s']:>9.3f}{r['of_floor']:>9.1%}" if with_floor else "")
                 for r in self.summary(floors)]
        return "\n".join(rows)

    def floors_by_group(self, hf_config, dtype_bytes: int, bandwidth: float, peak_flops: float, **kw) -> dict[str, float]:
        """step_seconds summed per summary group (keywords: step_seconds')."""
        opts = decoder_options(hf_config)
        out: dict[str, float] = {}
        for t in self.timings:
            g = self.group(t.is_prefill, t.num_tokens)
            out[g] = out.get(g, 0.0) + step_seconds(opts, t, dtype_bytes, bandwidth, peak_flops, **kw)
        return out


def git_commit() -> str:
    """HEAD's short hash, with "-dirty" when the tree differs from it (then the hash alone does
    not say what ran: e.g. a copy of a working tree shipped to another machine)."""
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                                       stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                                        text=True, stderr=subprocess.DEVNULL).strip()
        return head + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def run_hf(model_path: str, prompts, max_tokens, dtype, load_dummy: bool) -> float:
    """Hugging Face transformers continuous batching (paged|sdpa); returns output tok/s."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if load_dummy:
        cfg = AutoConfig.from_pretrained(model_path)
        cfg._attn_implementation = "paged|sdpa"
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="paged|sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="paged|sdpa",
                                                     device_map="cuda")
    model.eval()
    gen = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=True, temperature=0.6, eos_token_id=-1,
                           pad_token_id=0)
    try:
        from transformers.generation import ContinuousBatchingConfig

        extra = {"continuous_batching_config": ContinuousBatchingConfig(block_size=256)}
    except ImportError:
        extra = {}
    # Per-request output lengths through the manager API; the clock starts after its warm-up.
    with model.continuous_batching_context_manager(generation_config=gen, **extra) as manager:
        t = time.perf_counter()
        for p, n in zip(prompts, max_tokens):
            manager.add_request(p, max_new_tokens=n)
        finished = generated = 0
        while finished < len(prompts):
            r = manager.get_result(timeout=1)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped early")
                continue
            if r.is_finished():
                finished += 1
                generated += len(r.generated_tokens)
        dt = time.perf_counter() - t
    return generated / dt


def run_vllm(model_path: str, prompts, max_tokens, load_dummy: bool, tp: int) -> float | None:
    """vLLM on the same requests (as nano-vllm's bench did); None when vllm is not importable."""
    try:
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VSamplingParams
    except ImportError:
        print("vllm is not importable here; skipped --compare vllm", file=sys.stderr)
        return None
    llm = VLLM(model_path, max_model_len=4096, tensor_parallel_size=tp, load_format="dummy" if load_dummy else "auto",
               skip_tokenizer_init=load_dummy)
    params = [VSamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests[:1], params[:1], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(requests, params, use_tqdm=False)
    return sum(max_tokens) / (time.perf_counter() - t)


def add_round2_args(ap) -> None:
    """The options of the per-step floor and the KV-use report."""
    ap.add_argument("--peak-flops", type=float, default=H200_PEAK_BF16,
                    help="dense bf16 matrix FLOP/s of the per-step floor (default: the H200's)")
    ap.add_argument("--peak-flops-fp8", type=float, default=H200_PEAK_FP8,
                    help="FP8 matrix FLOP/s, used for the decoder projections when the weights are FP8")
    ap.add_argument("--kv-plot", help="also plot the KV-cache use over the timed run to this PNG (matplotlib)")


def floor_report(llm, timeline: StepTimeline, args, seconds: float, memory_floor: float | None, prompts,
                 max_tokens) -> dict:
    """The per-step floor of the timed run (rebuilt from its step timeline), its fraction, and
    the KV-cache use over the run: printed, and returned as JSON fields. Without a floor (off
    CUDA, no --bandwidth: the H200's figures would mean nothing), the steps and KV use alone."""
    report = {}
    if memory_floor is not None:
        report.update(step_floor_report(llm, timeline, args, seconds, memory_floor))
    else:
        print(timeline.table())
        report["timeline"] = timeline.summary()
    kv = kv_usage_report(timeline.kv, timeline.started, prompts, max_tokens, llm.config.max_num_seqs)
    if kv:
        k = kv["summary"]
        print(f"KV cache: live tokens mean {k['live_tokens_mean']:.0f} / peak {k['live_tokens_peak']}, allocated "
              f"mean {k['allocated_tokens_mean']:.0f} / peak {k['allocated_tokens_peak']} of {k['capacity_tokens']} "
              f"({k['fragmentation_of_allocated']:.1%} fragmentation), peak {k['running_peak']} requests; "
              f"static batching would reserve {k['static_batching_tokens']} ({k['static_over_paged_peak']:.2f}x "
              f"the paged peak)")
    return report | {"kv_usage": kv}


def step_floor_report(llm, timeline: StepTimeline, args, seconds: float, memory_floor: float) -> dict:
    """The per-step floor part of floor_report."""
    kv_bytes, linear_bytes = weight_element_bytes(llm)
    fp8_weights = llm.config.quant is not None and hasattr(llm.config.quant, "scheme")  # (INT4 multiplies in 16 bits)
    kw = dict(kv_bytes=kv_bytes, linear_bytes=linear_bytes,
              linear_peak_flops=args.peak_flops_fp8 if fp8_weights else args.peak_flops)
    dtype_bytes = llm.config.dtype.itemsize
    floor = step_floor(llm.config.hf_config, timeline.timings, dtype_bytes, args.bandwidth, args.peak_flops, **kw)
    tp = args.tp
    groups = {g: f / tp for g, f in timeline.floors_by_group(llm.config.hf_config, dtype_bytes, args.bandwidth,
                                                               args.peak_flops, **kw).items()}
    print(timeline.table(groups))
    total = floor.total_s / tp
    print(f"memory floor {memory_floor:.3f} s ({memory_floor / seconds:.1%} of it reached); per-step floor "
          f"{total:.3f} s: prefill {floor.prefill_s / tp:.3f} + decode {floor.decode_s / tp:.3f} "
          f"({total / seconds:.1%} reached; peak {kw['linear_peak_flops'] / 1e12:.0f} TFLOP/s for the projections)")
    return {"step_floor_s": round(total, 3), "step_floor_prefill_s": round(floor.prefill_s / tp, 3),
            "step_floor_decode_s": round(floor.decode_s / tp, 3), "fraction_of_step_floor": round(total / seconds, 3),
            "peak_flops": args.peak_flops, "peak_flops_linear": kw["linear_peak_flops"],
            "timeline": timeline.summary(groups)}


def data_parallel_floor(llm, prompts, max_tokens, args, kv_bytes, linear_bytes) -> float:
    """The roofline floor of the run: with --dp, the slowest replica's floor on its share of the
    requests (the front's sharding, recomputed), the replicas running side by side."""
    from nanovllm.launch.data_parallel import shard_by_work

    shards = shard_by_work([len(p) + n for p, n in zip(prompts, max_tokens)], args.dp)
    return max(roofline_floor(llm.config.hf_config, [prompts[i] for i in s], [max_tokens[i] for i in s],
                              llm.config.dtype.itemsize, args.bandwidth, kv_bytes=kv_bytes,
                              linear_bytes=linear_bytes) for s in shards if s) / args.tp


def finish_data_parallel(llm, args, name, out_tokens, in_tokens, seconds, floor, cold_start) -> None:
    """The figures of a --dp run, per replica too (prompts, tokens, seconds and output tok/s of
    its share), printed and written to --json."""
    replicas = [{"replica": s.replica, "prompts": s.prompts, "output_tokens": s.output_tokens,
                 "seconds": round(s.seconds, 3), "output_tok_s": round(s.output_tok_s, 1),
                 "startup_s": info["startup_seconds"], "kv_blocks": info["num_blocks"]}
                for s, info in zip(llm.replica_stats, llm.replica_info)]
    res = {"model": name, "gpu": gpu_name(), "commit": git_commit(), "tp": args.tp, "dp": args.dp,
           "num_seqs": args.num_seqs, "output_tokens": out_tokens, "seconds": round(seconds, 3),
           "output_tok_s": round(out_tokens / seconds, 1), "total_tok_s": round((in_tokens + out_tokens) / seconds, 1),
           **floor_fields(floor, seconds), "cold_start_s": round(cold_start, 2), "top_p": args.top_p,
           "top_k": args.top_k, "min_p": args.min_p, "replicas": replicas}
    llm.shutdown()
    print(json.dumps(res, indent=1))
    for r in replicas:
        print(f"replica {r['replica']}: {r['prompts']} prompts, {r['output_tokens']} tokens in {r['seconds']:.2f} s"
              f" = {r['output_tok_s']:.0f} tok/s")
    print(f"{name} x{args.dp}: {res['output_tok_s']:.0f} output tok/s"
          + (f", {res['fraction_of_floor']:.1%} of the floor" if floor is not None else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def floor_fields(floor: float | None, seconds: float) -> dict:
    """The memory floor's JSON fields (none without a floor)."""
    return {} if floor is None else {"floor_s": round(floor, 3), "fraction_of_floor": round(floor / seconds, 3)}


def wants_floors(args, device: str) -> bool:
    """Floors are the H200's figures by default: reported on CUDA, elsewhere only with --bandwidth
    (then --peak-flops should be the device's too)."""
    if args.bandwidth is None and device == "cuda":
        args.bandwidth = H200_COPY_BANDWIDTH
    return args.bandwidth is not None


def final_table(name: str, res: dict, cold_start: float) -> str:
    """The one-line summary at the end (floor columns only when the run has floors)."""
    floors = "floor_s" in res
    extra = [("HF tok/s", "hf_tok_s", 10, ".0f"), ("bs1 ms/tok", "decode_ms_per_token_bs1", 12, ".2f")]
    head = f"{'model':<12}{'out tok/s':>11}{'total tok/s':>13}" + (f"{'floor s':>9}" if floors else "") + \
        f"{'secs':>8}" + (f"{'of floor':>10}{'step floor s':>14}{'of it':>8}" if floors else "") + f"{'cold s':>8}"
    row = f"{name:<12}{res['output_tok_s']:>11.0f}{res['total_tok_s']:>13.0f}" + \
        (f"{res['floor_s']:>9.2f}" if floors else "") + f"{res['seconds']:>8.2f}" + \
        (f"{res['fraction_of_floor']:>10.1%}{res['step_floor_s']:>14.2f}{res['fraction_of_step_floor']:>8.1%}"
         if floors else "") + f"{cold_start:>8.1f}"
    for title, key, width, fmt in extra:
        if key in res:
            head, row = head + f"{title:>{width}}", row + f"{res[key]:>{width}{fmt}}"
    return head + "\n" + row


def say(message: str) -> None:
    """A phase of the run, to stderr (the figures go to stdout)."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder")
    src.add_argument("--dummy", choices=sorted(DUMMY_CONFIGS), help="real model shape, random weights")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024, help="prompts are randint(100, this) tokens")
    ap.add_argument("--max-output-len", type=int, default=1024, help="max_tokens are randint(100, this)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel replicas (LLM data_parallel_size): the JSON gets per-replica throughput")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--nccl-all-reduce", action="store_true",
                    help="TP: every all-reduce through NCCL (LLM custom_all_reduce=False)")
    ap.add_argument("--gather-logits", action="store_true",
                    help="TP: rank 0 gathers the logits and samples alone (default: every rank samples its vocabulary shard)")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-prefill-graph-tokens", type=int, default=None,
                    help="LLM(max_prefill_graph_tokens=...): prefill steps up to this many tokens replay graphs")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--kv-cache-dtype", default="auto", help='LLM(kv_cache_dtype=...): "auto" or "fp8"')
    ap.add_argument("--quantization", default=None, help='LLM(quantization=...): "fp8" quantizes the weights at load '
                    'time; "gptq" / "awq" with --dummy: random INT4 weights of the real shapes')
    ap.add_argument("--calculate-kv-scales", action="store_true", help="LLM(calculate_kv_scales=True)")
    ap.add_argument("--speculative-config", type=json.loads, default=None,
                    help='LLM(speculative_config=...) as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    ap.add_argument("--bandwidth", type=float, default=None,
                    help="memory bandwidth, B/s, of the floors (default: the H200's on CUDA; elsewhere no floors)")
    ap.add_argument("--compare", choices=["hf", "vllm"], action="append", default=[])
    ap.add_argument("--hf-num-seqs", type=int, default=32, help="requests run through the HF peer (a subset: it is slow)")
    ap.add_argument("--latency", action="store_true", help="also measure batch-1 decode ms/token")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler tables and device time per kind of kernel of a short run "
                         "(the workload's prompts, --profile-tokens each)")
    ap.add_argument("--profile-tokens", type=int, default=64,
                    help="output tokens per request of the profiled run; 0: the workload's own (the whole run)")
    ap.add_argument("--profile-fresh-prompts", action="store_true",
                    help="profile with prompts the prefix cache has not seen (every token id + 1, modulo "
                         "the workload's largest id + 1), so the profiled run prefills them all")
    ap.add_argument("--profile-startup", action="store_true",
                    help="only construct the LLM, under cProfile, and print where the cold start goes")
    ap.add_argument("--logprobs", type=int, metavar="K",
                    help="every timed (and profiled) request also asks for its K most likely tokens' logprobs "
                         "(SamplingParams.logprobs; measures what logprobs cost). Default: none")
    ap.add_argument("--top-p", type=float, default=1.0, help="SamplingParams.top_p of every request (default 1.0: off)")
    ap.add_argument("--top-k", type=int, default=0, help="SamplingParams.top_k of every request (default 0: off)")
    ap.add_argument("--min-p", type=float, default=0.0, help="SamplingParams.min_p of every request (default 0.0: off)")
    ap.add_argument("--cold-filters", action="store_true",
                    help="warm up without the filters: the timed run is their first use (any compile in it)")
    ap.add_argument("--json", help="write the figures to this file")
    add_round2_args(ap)
    args = ap.parse_args(argv)
    if min(args.num_seqs, args.max_input_len, args.max_output_len) < 1:
        ap.error("--num-seqs, --max-input-len and --max-output-len must be >= 1")
    if args.dp > 1 and (args.latency or args.profile or args.profile_startup or args.gather_logits):
        ap.error("--dp > 1 measures throughput only (no --latency, --profile, --profile-startup, --gather-logits)")
    return args


def profile_startup(path: str, args) -> None:
    """--profile-startup: construct the LLM under cProfile and print where the cold start goes."""
    import cProfile
    import pstats

    from nanovllm import LLM

    with cProfile.Profile() as prof:
        LLM(path, load_format="dummy" if args.dummy else "auto", skip_tokenizer_init=bool(args.dummy),
            tensor_parallel_size=args.tp, max_model_len=4096).shutdown()
    stats = pstats.Stats(prof).sort_stats("cumulative")
    stats.print_stats(25)  # everything: on a bare machine imports and JIT dominate
    stats.print_stats("nanovllm", 40)  # our own code alone, which the list above may crowd out


def load(path: str, args):
    """(the LLM of the run, its cold start in seconds)."""
    from nanovllm import LLM

    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy" if args.dummy else "auto", skip_tokenizer_init=bool(args.dummy),
              tensor_parallel_size=args.tp, enforce_eager=args.enforce_eager, max_model_len=4096,
              custom_all_reduce=not args.nccl_all_reduce, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kvcache_block_size=args.block_size,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
              calculate_kv_scales=args.calculate_kv_scales, speculative_config=args.speculative_config,
              **({"data_parallel_size": args.dp} if args.dp > 1 else {}),
              **({} if args.max_prefill_graph_tokens is None else
                 {"max_prefill_graph_tokens": args.max_prefill_graph_tokens}))
    cold_start = time.perf_counter() - t0
    if args.tp > 1 and args.gather_logits:
        llm.model_runner.sample_on_every_rank = False
    return llm, cold_start


def timed_run(llm, args, prompts, max_tokens, extra: dict):
    """The warm-up, then the timed generate of the workload: (seconds, its StepTimeline or None)."""
    import torch

    from nanovllm import SamplingParams

    warm = {} if args.cold_filters else extra  # --cold-filters: the filters' first use is timed
    llm.generate([[1, 2, 3]] * args.dp, SamplingParams(**warm), use_tqdm=False)  # warm-up (every replica)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, **extra) for n in max_tokens]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    say(f"timed run: {len(prompts)} requests, {sum(max_tokens)} output tokens")
    t = time.perf_counter()
    # Per step: two clock reads, the step's shape (one pass over its rows) and a KV-use sample
    # (one pass over the running requests): ~10 us at 256 requests. Replicas step on their own:
    # no timeline of one engine's steps with --dp.
    with (StepTimeline(llm, kv_usage=True) if args.dp == 1 else contextlib.nullcontext()) as timeline, \
            observing(llm, Progress("timed run") if args.dp == 1 else None):
        outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    out_tokens = sum(len(o["token_ids"]) for o in outs)
    if out_tokens != sum(max_tokens):
        raise SystemExit(f"expected {sum(max_tokens)} output tokens, got {out_tokens}")
    return seconds, timeline


def run_result(llm, args, name: str, seconds: float, floor: float | None, cold_start: float, out_tokens: int,
               in_tokens: int) -> dict:
    """The JSON figures of a single-engine run (before the floor report and the extras)."""
    rank0 = getattr(llm.model_runner, "runner", llm.model_runner)  # TP: rank 0's ModelRunner
    return {"model": name, "gpu": gpu_name(), "commit": git_commit(), "tp": args.tp, "num_seqs": args.num_seqs,
            "output_tokens": out_tokens, "seconds": round(seconds, 3), "output_tok_s": round(out_tokens / seconds, 1),
            "total_tok_s": round((in_tokens + out_tokens) / seconds, 1), **floor_fields(floor, seconds),
            "cold_start_s": round(cold_start, 2),
            "preemptions": llm.scheduler.num_preemptions, "kv_blocks": llm.block_manager.num_blocks,
            "kv_tokens": llm.block_manager.num_blocks * args.block_size, "kv_cache_dtype": args.kv_cache_dtype,
            "quantization": quantization_name(llm.config.quant),
            "enforce_eager": args.enforce_eager, "custom_all_reduce": not args.nccl_all_reduce,
            "copy_engine_all_reduce": getattr(rank0.tp, "copy_engine", None) is not None,
            "sample_on_every_rank": args.tp > 1 and not args.gather_logits and args.logprobs is None,
            "logprobs": args.logprobs, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
            "startup_s": llm.model_runner.startup_seconds, **speculation_fields(llm, args)}


def speculation_fields(llm, args) -> dict:
    """--speculative-config: the config and the mean accepted length (1 + accepted drafts per
    verification) over the engine's life so far."""
    if args.speculative_config is None:
        return {}
    from nanovllm.features.speculative.drafting import draft_counts

    c = draft_counts(llm.scheduler)
    length = round(1 + c.num_accepted_tokens / c.num_drafts, 3) if c is not None and c.num_drafts else None
    return {"speculative_config": args.speculative_config, "mean_accepted_length": length}


def batch1_latency(llm, prompts) -> float:
    """--latency: batch-1 decode ms per token (the first token's time taken out)."""
    from nanovllm import SamplingParams

    say("batch-1 latency")
    p = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    prompt = [prompts[0][:128]]
    llm.generate(prompt, p, use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompt, p, use_tqdm=False)
    t_first = time.perf_counter() - t
    n = 256
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n + 1), use_tqdm=False)
    return round((time.perf_counter() - t - t_first) / n * 1e3, 3)


def profiled_run(llm, args, prompts, max_tokens, extra: dict, max_id: int) -> dict:
    """--profile: a short run under torch.profiler; its tables printed, its figures returned."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanovllm import SamplingParams

    short = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.profile_tokens or n, **extra)
             for n in max_tokens]
    cuda = torch.cuda.is_available()  # on a CPU the run is profiled too, with no kernels to list
    profiled = [[(t + 1) % (max_id + 1) for t in p] for p in prompts] if args.profile_fresh_prompts else prompts
    say("profiled run")
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof, \
            StepTimeline(llm) as profiled_steps:
        t = time.perf_counter()
        llm.generate(profiled, short, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    # GPU idle time = wall - kernel time: what host overhead between kernels costs.
    kernels = profiled_kernels(prof)
    busy = sum(us for _, us in kernels) / 1e6
    print(f"profiled run: wall {wall:.3f} s, GPU kernels {busy:.3f} s ({busy / wall:.0%} busy)")
    breakdown = kernel_breakdown(kernels)
    for kind, secs in breakdown.items():
        print(f"  {kind:<32}{secs * 1e3:>10.1f} ms{secs / max(busy, 1e-9):>7.1%}")
    print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40,
                                    max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))
    return {"tokens": args.profile_tokens, "fresh_prompts": args.profile_fresh_prompts,
            "prefill_tokens": sum(n for prefill, n, _, _ in profiled_steps.steps if prefill),
            "wall_s": round(wall, 3), "kernels_s": {k: round(v, 4) for k, v in breakdown.items()}}


def compare_peers(res: dict, args, path: str, prompts, max_tokens) -> None:
    """--compare hf / vllm: the peers' throughput into `res` (after the LLM is shut down)."""
    import torch

    if "hf" in args.compare:
        say("the transformers peer")
        k = min(args.hf_num_seqs, len(prompts))
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        hf_tps = run_hf(path, prompts[:k], max_tokens[:k], torch.bfloat16, bool(args.dummy))
        res["hf_tok_s"] = round(hf_tps, 1)
        res["hf_num_seqs"] = k
    if "vllm" in args.compare:
        res["vllm_tok_s"] = run_vllm(path, prompts, max_tokens, bool(args.dummy), args.tp)


def write_result(res: dict, name: str, cold_start: float, args) -> None:
    """The figures: printed (the KV-use time series goes to --json only), to --json, --kv-plot."""
    print(json.dumps(res | {"kv_usage": res["kv_usage"].get("summary")}, indent=1))
    print("\n" + final_table(name, res, cold_start))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.kv_plot:
        from benchmarks.plot_kv_usage import plot_kv_usage

        try:
            plot_kv_usage(res, args.kv_plot)
        except ImportError as e:  # matplotlib is optional (and absent on some GPU machines)
            print(f"--kv-plot: {e}; plot it later: python benchmarks/plot_kv_usage.py RESULT.json OUT.png",
                  file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    path = os.path.join(HERE, DUMMY_CONFIGS[args.dummy]) if args.dummy else args.model
    name = args.dummy or os.path.basename(os.path.normpath(path)).lower()
    if args.profile_startup:
        return profile_startup(path, args)

    say(f"loading {name}")
    llm, cold_start = load(path, args)
    max_id = workload_max_id(llm.config.hf_config.vocab_size)
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len, max_id=max_id)
    floors = wants_floors(args, llm.config.device)
    # The default workload uses none of the optional sampling features (logprobs, penalties, n > 1):
    # plain temperature sampling, as nano-vllm's bench.py.
    extra = {} if args.logprobs is None else {"logprobs": args.logprobs}
    extra.update(top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)  # the filters (off by default)
    say(f"started in {cold_start:.1f} s; warm-up")
    seconds, timeline = timed_run(llm, args, prompts, max_tokens, extra)
    out_tokens, in_tokens = sum(max_tokens), sum(map(len, prompts))
    kv_bytes, linear_bytes = weight_element_bytes(llm)
    floor = data_parallel_floor(llm, prompts, max_tokens, args, kv_bytes, linear_bytes) if floors else None
    if args.dp > 1:
        return finish_data_parallel(llm, args, name, out_tokens, in_tokens, seconds, floor, cold_start)
    res = run_result(llm, args, name, seconds, floor, cold_start, out_tokens, in_tokens)
    res.update(floor_report(llm, timeline, args, seconds, floor, prompts, max_tokens))
    if args.latency:
        res["decode_ms_per_token_bs1"] = batch1_latency(llm, prompts)
    if args.profile:
        res["profile"] = profiled_run(llm, args, prompts, max_tokens, extra, max_id)
    llm.shutdown()
    del llm
    compare_peers(res, args, path, prompts, max_tokens)
    write_result(res, name, cold_start, args)


if __name__ == "__main__":
    main()
