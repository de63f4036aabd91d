"""Serving benchmark: N concurrent streaming clients against `python -m nanovllm.serve`.

    python benchmarks/serve_bench.py --dummy qwen3-0.6b --clients 64 --out serve.json
    python benchmarks/serve_bench.py --model /path/to/ckpt --clients 16 --requests 64 --offline none

It starts the server itself (a subprocess on 127.0.0.1, on a free port), sends a warm-up round,
then the workload: bench.py's requests (random.seed(0); prompts of randint(100, 1024) token ids
below 10,000; max_tokens randint(100, 1024); ignore_eos), `--requests` of them, taken in order
by `--clients` concurrent clients (each sends its next request when the last one ends: a closed
loop), spread over `--client-processes` processes (taking requests from one shared counter), so that
the clients' own Python (an SSE line parsed per token) does not become what is measured. Each is a streaming /v1/completions request with token-id prompts and
`return_token_ids`, so every chunk is one engine step's token of it. It stops the server and
then, unless `--offline none`, runs the same requests through the offline `LLM.generate` in
this process (split steps, and with `--offline both` also mixed steps), for the throughput ratio,
and once more with the server's options and at most `--clients` requests at a time (the closed
loop's own schedule without HTTP: the ratio against it is what the server itself costs).

Reported (JSON, `--out`, and printed): output tokens per second over the whole run, requests
per second, time to first token (send -> first token chunk), inter-token latency (gaps between a
request's successive token chunks, pooled over all requests) and end-to-end latency, each as
mean / p50 / p90 / p99 in milliseconds (seconds for end-to-end). With `--dummy` the model has
random weights (load_format="dummy") and no tokenizer (skip_tokenizer_init): token ids in,
token ids out.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import bench  # noqa: E402  (ROOT/bench.py: the dummy configs and the workload)

DUMMY_CONFIGS = {name: os.path.join(ROOT, rel) for name, rel in bench.DUMMY_CONFIGS.items()}


def workload(num: int, vocab: int, min_in: int = 100, max_in: int = 1024, min_out: int = 100, max_out: int = 1024):
    """bench.py's requests ((prompt ids, max_tokens) in its RNG order), token ids below the
    vocabulary for a model smaller than 10,000 tokens."""
    return bench.workload(num, max_in, max_out, min_in, min_out, max_id=min(10000, vocab - 1))


def server_flags(args) -> list[str]:
    """The server's flags: --server-args, with the dummy-model ones first under --dummy."""
    flags = shlex.split(args.server_args)
    return ["--load-format", "dummy", "--skip-tokenizer-init"] + flags if args.dummy else flags


def percentiles(xs: list[float], scale: float = 1.0) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def q(p):  # nearest rank
        return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))] * scale

    return {"n": len(s), "mean": statistics.fmean(s) * scale, "p50": q(50), "p90": q(90), "p99": q(99),
            "max": s[-1] * scale}


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streaming completion; its timings (perf_counter seconds) and token count."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    sent = time.perf_counter()
    stamps, tokens, finish = [], 0, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"stream error: {data['error']}")
            for choice in data["choices"]:
                n = len(choice.get("token_ids") or ())
                if n:
                    stamps.append(time.perf_counter())
                    tokens += n
                finish = choice.get("finish_reason") or finish
    if tokens != max_tokens:
        raise RuntimeError(f"got {tokens} tokens of {max_tokens} (finish_reason {finish})")
    return {"sent": sent, "stamps": stamps, "tokens": tokens}


async def drive(url: str, model: str, prompts, max_tokens, clients: int, timeout: float,
                take=None) -> tuple[dict[int, dict], float]:
    """Closed loop: `clients` workers each take the next request (`take()`: its index, or None
    when none is left; by default the requests in order) until none is left. Results by request
    index; each also says when its worker found none left ("worker_done"; the same for all of
    a worker's results)."""
    import httpx

    if take is None:
        order = iter(range(len(prompts)))

        def take():
            return next(order, None)

    results: dict[int, dict] = {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        async def worker():
            mine = []
            while (i := take()) is not None:
                results[i] = await one_request(client, url, model, prompts[i], max_tokens[i])
                mine.append(results[i])
            done = time.perf_counter()
            for r in mine:
                r["worker_done"] = done

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(clients))), timeout)
        wall = time.perf_counter() - t0
    return results, wall


_shared_next = None  # a client process's handle on the run's next-request counter (fork-inherited)


def _share_counter(counter) -> None:
    global _shared_next
    _shared_next = counter


def _take_shared(total: int):
    """The next request index from the counter every client process shares, or None."""
    with _shared_next.get_lock():
        i = _shared_next.value
        if i >= total:
            return None
        _shared_next.value = i + 1
    return i


def _drive_share(url, model, prompts, max_tokens, clients, timeout):
    """One client process's part of the run: its results and (start, end) perf_counter times
    (CLOCK_MONOTONIC: comparable across processes). A failure empties the shared counter first,
    so that the other processes stop after their open requests instead of running the rest."""
    t0 = time.perf_counter()
    try:
        results, wall = asyncio.run(drive(url, model, prompts, max_tokens, clients, timeout,
                                          take=lambda: _take_shared(len(prompts))))
    except BaseException:
        with _shared_next.get_lock():
            _shared_next.value = len(prompts)
        raise
    return results, t0, t0 + wall


def drive_processes(url: str, model: str, prompts, max_tokens, clients: int, processes: int,
                    timeout: float) -> tuple[list[dict], float]:
    """drive() over `processes` client processes (clients split evenly), all taking the next
    request from one shared counter: one closed loop, as if every client were in one process
    (a fixed share per process would leave some processes' clients idle while others still
    queue: a longer tail than the loop itself has). The wall time runs from the first start to
    the last end."""
    processes = max(1, min(processes, clients, len(prompts)))
    if processes == 1:
        results, wall = asyncio.run(drive(url, model, prompts, max_tokens, clients, timeout))
        return [results[i] for i in range(len(prompts))], wall
    import concurrent.futures
    import multiprocessing

    # fork: this process has not touched a GPU (the server is a subprocess) and the workers need
    # nothing but drive() and the counter.
    ctx = multiprocessing.get_context("fork")
    counter = ctx.Value("q", 0)
    shares = [clients // processes + (p < clients % processes) for p in range(processes)]
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx, initializer=_share_counter,
                                                initargs=(counter,)) as pool:
        parts = list(pool.map(_drive_share, *zip(*[(url, model, prompts, max_tokens, n, timeout) for n in shares])))
    merged = {i: r for share, _, _ in parts for i, r in share.items()}
    return [merged[i] for i in range(len(prompts))], max(end for _, _, end in parts) - min(s for _, s, _ in parts)


def steady_state(results: list[dict], clients: int) -> dict:
    """Output tokens per second while every client had a request open: from the moment the
    last of the first `clients` requests had its first token to the moment the first client
    found no request left (after it, fewer streams are open: the closed loop's tail)."""
    first = sorted(results, key=lambda r: r["sent"])[:clients]
    start = max(r["stamps"][0] for r in first)
    end = min(r["worker_done"] for r in results)
    if end <= start:
        return {"window_s": 0.0, "output_tok_s": None}
    tokens = sum(start <= t < end for r in results for t in r["stamps"])
    return {"window_s": end - start, "output_tok_s": tokens / (end - start)}


def latencies(results: list[dict], wall: float) -> dict:
    """Throughput, time to first token, inter-token gaps and end-to-end latency of requests
    {"sent": time, "stamps": [time of each token chunk], "tokens": count}."""
    ttft = [r["stamps"][0] - r["sent"] for r in results]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    e2e = [r["stamps"][-1] - r["sent"] for r in results]
    out = sum(r["tokens"] for r in results)
    return {"wall_s": wall, "output_tokens": out, "output_tok_s": out / wall, "requests_per_s": len(results) / wall,
            "ttft_ms": percentiles(ttft, 1e3), "itl_ms": percentiles(itl, 1e3), "e2e_s": percentiles(e2e),
            # Chunks of one stream that arrived together (the server writes every chunk a stream
            # has pending at once when it falls behind): gaps near zero that pull the ITL down.
            "itl_under_0.2ms_share": sum(g < 2e-4 for g in itl) / len(itl) if itl else 0.0}


def summarize(results: list[dict], wall: float, clients: int) -> dict:
    return {**latencies(results, wall), "steady_state": steady_state(results, clients)}


def fresh(prompts, vocab: int, max_id: int = 10000, shift: int = 1):
    """The same prompt lengths with other token ids (every id + shift, wrapping below the
    vocabulary and 10,001): a warm-up that leaves nothing in the prefix cache for the run (and
    with another shift, a pass that finds nothing of the warm-up's)."""
    top = min(max_id + 1, vocab)
    return [[(t + shift) % top for t in p] for p in prompts]


def engine_steps(step_log: str, start: float, end: float) -> dict:
    """step_stats of the server's --step-log (one StepTiming JSON line per step)."""
    with open(step_log) as f:
        return step_stats([json.loads(line) for line in f], start, end)


def step_stats(steps: list[dict], start: float, end: float) -> dict:
    """The engine's steps (StepTiming dicts) that ended inside [start, end]: for decode steps
    and for prompt-carrying (mixed) ones, how many, their time in all, the gap before each (ms:
    the time from the previous step's end, what a stream waits between tokens) and the part of
    it the host spent waiting for the device (wait_ms)."""
    out = {}
    # A step of no tokens only launched the first step after the engine sat idle: its gap is the
    # idle time, not a step's.
    timed = [(a, b) for a, b in zip(steps, steps[1:]) if b["num_tokens"] and start <= b["ended_at"] <= end]
    for kind, prefill in (("decode", False), ("prompt", True)):
        gaps = [b["ended_at"] - a["ended_at"] for a, b in timed if b["is_prefill"] == prefill]
        rows = [b["num_seqs"] for _, b in timed if b["is_prefill"] == prefill]
        waits = [b["wait_s"] for _, b in timed if b["is_prefill"] == prefill]
        tokens = [b["num_tokens"] for _, b in timed if b["is_prefill"] == prefill]
        out[kind] = {"steps": len(gaps), "seconds": sum(gaps), "gap_ms": percentiles(gaps, 1e3),
                     "wait_ms": percentiles(waits, 1e3), "mean_rows": statistics.fmean(rows) if rows else 0.0,
                     "mean_tokens": statistics.fmean(tokens) if tokens else 0.0}
    return out


def run_server(args, path: str, prompts, max_tokens) -> dict:
    import tempfile

    from nanovllm.serve.launcher import ServerProcess

    step_log = os.path.join(tempfile.mkdtemp(prefix="serve_bench_"), "steps.jsonl")
    flags = server_flags(args) + ["--log-level", "warning", "--step-log", step_log]
    t = time.perf_counter()
    with ServerProcess(path, flags, timeout=args.startup_timeout, cwd=ROOT) as server:
        startup = time.perf_counter() - t
        # Warm-up: the workload's prompt lengths with other ids (nothing to reuse from the prefix
        # cache), at most 32 tokens out, at full concurrency: prefill and mixed-step shapes compile
        # their kernels here, not in the timed run.
        drive_processes(server.url, path, fresh(prompts, args.vocab), [min(n, 32) for n in max_tokens], args.clients,
                        args.client_processes, args.timeout)
        results, wall = drive_processes(server.url, path, prompts, max_tokens, args.clients, args.client_processes,
                                        args.timeout)
        rc = server.stop(60)
    report = summarize(results, wall, args.clients)
    start = min(r["sent"] for r in results)
    if args.keep_logs:  # the raw material of the percentiles, for a look at the outliers
        os.makedirs(args.keep_logs, exist_ok=True)
        shutil.copy(step_log, os.path.join(args.keep_logs, "server_steps.jsonl"))
        with open(os.path.join(args.keep_logs, "server_requests.json"), "w") as f:
            json.dump([{"prompt_tokens": len(p), "max_tokens": n, **r}
                       for p, n, r in zip(prompts, max_tokens, results)], f)
    report.update(startup_s=startup, exit_code=rc, engine_steps=engine_steps(step_log, start, start + wall))
    return report


def server_llm(args, path: str, **overrides):
    """An LLM with the server's options, parsed by the server's own parser (the same engine),
    with `overrides` on top."""
    from nanovllm import LLM

    return LLM(path, **{**server_options(args, path), **overrides})


def server_options(args, path: str) -> dict:
    """The LLM options the server runs with (its flags, parsed by its own parser)."""
    from nanovllm.serve.cli import build_parser, llm_options

    return llm_options(build_parser().parse_args([path, *server_flags(args)]))


def run_offline(args, path: str, prompts, max_tokens, **overrides) -> dict:
    """LLM.generate on the requests (after a warm-up as the server's), with the server's
    options and `overrides` on top."""
    from nanovllm import SamplingParams

    llm = server_llm(args, path, **overrides)
    try:
        sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
        warm = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=min(n, 32)) for n in max_tokens]
        llm.generate(fresh(prompts, args.vocab), warm, use_tqdm=False)  # warm-up, as the server's
        t = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        seconds = time.perf_counter() - t
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds}


def run_closed_loop(args, path: str, prompts, max_tokens) -> dict:
    """The server's engine (its LLM options, mixed steps) driven in this process by the same
    closed loop, with no HTTP: `clients` requests open at once, the next one added when one ends.
    What the engine alone does under the server's arrival pattern, to tell its cost from the
    HTTP side's. With --profile DIR, an untimed second pass (max_tokens capped at 200) profiles
    its steps 100-300: the torch profiler's tables (by device time and by host time) go to
    DIR/closed_loop_profile.txt."""
    import torch

    from nanovllm import SamplingParams

    llm = server_llm(args, path)
    steps: list[dict] = []
    llm.step_observers.append(lambda t: steps.append(dataclasses.asdict(t)))
    try:
        def loop(prompt_list, token_list, profile_dir=None):
            todo = iter(range(len(prompt_list)))
            open_, stamps, counts = {}, {}, {}
            def add():
                i = next(todo, None)
                if i is not None:
                    seq = llm.add_request(prompt_list[i], SamplingParams(temperature=0.6, ignore_eos=True,
                                                                         max_tokens=token_list[i]))
                    open_[seq.seq_id] = i
                    stamps[i] = [time.perf_counter()]
            for _ in range(args.clients):
                add()
            prof, n = None, 0

            def write_profile():
                prof.__exit__(None, None, None)
                with open(os.path.join(profile_dir, "closed_loop_profile.txt"), "w") as f:
                    for key in ("cuda_time_total", "cpu_time_total"):
                        f.write(prof.key_averages().table(sort_by=key, row_limit=40) + "\n")

            while llm.has_unfinished():
                if profile_dir and n == 100:
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                              torch.profiler.ProfilerActivity.CUDA])
                    prof.__enter__()
                outputs = llm.step().outputs
                n += 1
                if prof is not None and n == 300:
                    write_profile()
                    prof = None
                now = time.perf_counter()
                for o in outputs:
                    i = open_[o.seq.seq_id]
                    if o.new_token_ids:
                        stamps[i].append(now)
                        counts[i] = counts.get(i, 0) + len(o.new_token_ids)
                    if o.finished:
                        del open_[o.seq.seq_id]
                        add()
            if prof is not None:  # a pass shorter than 300 steps
                write_profile()
            return stamps, counts

        loop(fresh(prompts, args.vocab), [min(n, 32) for n in max_tokens])  # warm-up, as the server's
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        steps.clear()
        before = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        compiled = triton_cache_entries()
        t = time.perf_counter()
        stamps, counts = loop(prompts, max_tokens)
        wall = time.perf_counter() - t
        compiled = triton_cache_entries() - compiled
        after = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        timed_steps = list(steps)
        if args.profile:  # an untimed pass of its own: the profiler slows what it watches
            loop(fresh(prompts, args.vocab, shift=2), [min(n, 200) for n in max_tokens], args.profile)
    finally:
        llm.shutdown()
    # The requests as the HTTP clients report theirs: sent, token chunk times, tokens.
    results = [{"sent": s[0], "stamps": s[1:], "tokens": counts.get(i, 0)} for i, s in stamps.items()]
    report = {"seconds": wall, **latencies(results, wall),
              "engine_steps": step_stats(timed_steps, -math.inf, math.inf)}
    # Allocator events in the timed run: a cudaMalloc retry frees the cache and synchronizes.
    report["cuda_allocator"] = {k: after.get(k, 0) - before.get(k, 0)
                                for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}
    # Triton kernels compiled during the timed run (new entries in its cache folder): a shape the
    # warm-up did not cover, which stalls its step for the compile.
    report["triton_compiles"] = compiled
    return report


def triton_cache_entries() -> int:
    folder = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return len(os.listdir(folder)) if os.path.isdir(folder) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--dummy", choices=sorted(DUMMY_CONFIGS), help="real model shape, random weights, no tokenizer")
    src.add_argument("--model", help="a checkpoint folder")
    ap.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    ap.add_argument("--requests", type=int, default=256, help="requests in the timed run")
    ap.add_argument("--client-processes", type=int, default=4, help="processes the clients are spread over")
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--server-args", default="", help="more flags for the server (LLM options), one string")
    ap.add_argument("--offline", choices=["split", "both", "none"], default="split",
                    help="also run the requests through LLM.generate: split steps, split and mixed, or not "
                         "(unless none, also with the server's options at most --clients at a time)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole timed run")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("--keep-logs", metavar="DIR",
                    help="keep the server's step log (server_steps.jsonl) and every request's send and token "
                         "times (server_requests.json) in DIR")
    ap.add_argument("--closed-loop", action="store_true",
                    help="also drive the server's engine in this process by the same closed loop, without HTTP")
    ap.add_argument("--profile", metavar="DIR", help="with --closed-loop: profile 200 steps of a second, untimed pass into DIR")
    args = ap.parse_args(argv)
    path = DUMMY_CONFIGS[args.dummy] if args.dummy else args.model
    with open(os.path.join(path, "config.json")) as f:
        args.vocab = json.load(f)["vocab_size"]
    prompts, max_tokens = workload(args.requests, args.vocab, args.min_input, args.max_input, args.min_output,
                                   args.max_output)
    report = {"model": args.dummy or path, "clients": args.clients, "client_processes": args.client_processes,
              "requests": args.requests,
              "prompt_tokens": sum(map(len, prompts)), "server_args": args.server_args,
              "server": run_server(args, path, prompts, max_tokens)}
    if args.offline != "none":
        report["offline"] = run_offline(args, path, prompts, max_tokens, mixed_steps=False)
        report["server_vs_offline"] = report["server"]["output_tok_s"] / report["offline"]["output_tok_s"]
        # The server's own engine and options holding at most `clients` requests (or its own
        # max_num_seqs, if lower), admitting the next one as one ends: the closed loop's schedule
        # without HTTP or arrival latency. The ratio against it is the server's own cost; the one
        # against unbounded offline also carries what running `clients` rows instead of all at
        # once costs.
        rows = min(args.clients, server_options(args, path).get("max_num_seqs", args.clients))
        report["offline_at_clients"] = run_offline(args, path, prompts, max_tokens, max_num_seqs=rows)
        report["server_vs_offline_at_clients"] = (report["server"]["output_tok_s"]
                                                  / report["offline_at_clients"]["output_tok_s"])
    if args.closed_loop:
        report["closed_loop"] = run_closed_loop(args, path, prompts, max_tokens)
    if args.offline == "both":
        report["offline_mixed"] = run_offline(args, path, prompts, max_tokens, mixed_steps=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
