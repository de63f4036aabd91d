"""Multi-LoRA's cost: the bench workload (bench.py's 256 requests, dummy weights) with every request
on one of N random adapters (rank 16 on q/k/v/o and gate/up/down of every layer, as PEFT writes
them), against the same workload on the base model without LoRA, in one process.

    python benchmarks/lora_bench.py --dummy qwen3-8b [--adapters 8] [--rank 16] [--json out.json]

The adapters' first loads happen in a warm-up (each reads ~90 MB for Qwen3-8B), so the timed run
measures serving them: the shrink / expand kernels in every projection, inside CUDA graphs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from bench import DUMMY_CONFIGS, workload, workload_max_id  # noqa: E402


def write_adapter(folder: str, config: dict, rank: int, seed: int) -> None:
    """A PEFT adapter folder of random updates for every projection of every layer."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
              "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
              "mlp.down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) / n_in ** 0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.01).bfloat16()
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": [n.split(".")[1] for n in shapes]}, f)


def timed(llm, prompts, max_tokens, lora_requests) -> float:
    import torch

    from nanovllm import SamplingParams

    warm = SamplingParams(max_tokens=4)
    if lora_requests:  # every adapter's first load, outside the timed run
        llm.generate([[1, 2, 3]] * len(lora_requests), warm, use_tqdm=False, lora_request=lora_requests)
    else:
        llm.generate([[1, 2, 3]], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    per_request = [lora_requests[i % len(lora_requests)] for i in range(len(prompts))] if lora_requests else None
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=per_request)
    sync()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dummy", choices=sorted(DUMMY_CONFIGS), default="qwen3-8b")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024, help="longest prompt and output (short: smoke runs)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    from nanovllm import LLM
    from nanovllm.lora.request import LoRARequest

    folder = os.path.join(HERE, DUMMY_CONFIGS[args.dummy])
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    prompts, max_tokens = workload(args.num_seqs, args.max_len, args.max_len, max_id=workload_max_id(config["vocab_size"]))
    out_tokens = sum(max_tokens)
    common = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, kvcache_block_size=256,
                  max_num_seqs=512, max_num_batched_tokens=16384)  # (bench.py's settings)
    seconds = {}
    llm = LLM(folder, **common)
    seconds["base"] = timed(llm, prompts, max_tokens, None)
    print(f"base: {out_tokens / seconds['base']:,.0f} output tok/s", flush=True)
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    adapters = tempfile.mkdtemp(prefix="lora_bench_")
    t = time.perf_counter()
    requests = []
    for i in range(args.adapters):
        write_adapter(os.path.join(adapters, f"a{i}"), config, args.rank, seed=i)
        requests.append(LoRARequest(f"a{i}", i + 1, os.path.join(adapters, f"a{i}")))
    print(f"{args.adapters} adapters written in {time.perf_counter() - t:.1f} s", flush=True)
    llm = LLM(folder, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **common)
    name = f"lora{args.adapters}"
    seconds[name] = timed(llm, prompts, max_tokens, requests)
    print(f"{name}: {out_tokens / seconds[name]:,.0f} output tok/s", flush=True)
    llm.shutdown()
    result = {"what": f"bench workload ({args.num_seqs} requests), dummy {args.dummy}; every request on one of "
                      f"{args.adapters} rank-{args.rank} adapters (all 7 projections) vs the base model without LoRA",
              "output_tok_s": {k: round(out_tokens / s, 1) for k, s in seconds.items()},
              "ratio_to_base": round(seconds["base"] / seconds[name], 3), "seconds": seconds}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
