"""Structured outputs' cost: the bench workload (bench.py's 256 requests) with every request
constrained by a JSON schema, against the same workload unconstrained, in one process.

Dummy weights have no tokenizer, so one of Qwen3's vocabulary size is built here: a byte-level
BPE whose 151,643 tokens are made by merging random pairs of shorter ones (mostly printable
ASCII, like a real vocabulary's), plus Qwen's special tokens. xgrammar then does the work it does
for a real model: a token mask over the whole vocabulary every step, for every row. Its tokens
hold `"` or a backslash far more often than a real vocabulary's (13% against Qwen's 1.1%), and
those are the tokens xgrammar checks one by one inside a string: `--vocab-file qwen.tiktoken`
uses Qwen2/3's real tokens instead (the file ships in the dashscope wheel; carry it to the GPU).

    python benchmarks/structured_bench.py --dummy qwen3-0.6b [--vocab-file F] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from bench import DUMMY_CONFIGS, workload  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Every output stays inside the schema for all its tokens: 2,000 items at least, ~15 tokens each,
# never complete within the workload's outputs (a complete value would leave only EOS, and
# ignore_eos would run the rest unconstrained).
ITEM = {"type": "object", "properties": {
    "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 0, "maximum": 9999},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4}},
    "required": ["sku", "qty", "tags"]}
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                           "items": {"type": "array", "items": ITEM, "minItems": 2000}},
          "required": ["id", "name", "items"]}


def byte_chars() -> dict[int, str]:
    """Byte-level BPE's characters for the 256 bytes: printable ones stand for themselves, the
    others for code points from 256 on, in byte order."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return chars


def save_byte_level(folder: str, vocab: dict[str, int], merges: list) -> None:
    """A byte-level BPE tokenizer of `vocab` and `merges` + SPECIALS, saved in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS})
    fast.save_pretrained(folder)


def byte_level_bpe(folder: str, size: int, seed: int = 0) -> None:
    """A byte-level BPE tokenizer of `size` regular tokens (+ SPECIALS) saved in `folder`."""
    byte_char = byte_chars()
    printable = [byte_char[b] for b in range(32, 127)]
    rng = random.Random(seed)
    tokens, vocab, merges = list(byte_char.values()), {}, []
    for t in tokens:
        vocab[t] = len(vocab)
    while len(vocab) < size:
        a = rng.choice(printable) if rng.random() < 0.5 else rng.choice(tokens[-4096:] if rng.random() < 0.5 else tokens)
        b = rng.choice(printable) if rng.random() < 0.7 else rng.choice(tokens)
        if len(a) + len(b) > 12 or a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        tokens.append(a + b)
        merges.append((a, b))
    save_byte_level(folder, vocab, merges)


def tiktoken_bpe(folder: str, path: str) -> None:
    """A byte-level tokenizer of a tiktoken file's tokens (base64 bytes and rank a line: Qwen's
    `qwen.tiktoken`, which the dashscope wheel ships, holds Qwen2/3's 151,643 regular tokens) +
    SPECIALS, saved in `folder`. No merges: the bench's prompts are token ids, and xgrammar reads
    only the tokens' strings."""
    byte_char, vocab = byte_chars(), {}
    with open(path) as f:
        for line in f:
            token, rank = line.split()
            vocab["".join(byte_char[b] for b in base64.b64decode(token))] = int(rank)
    save_byte_level(folder, vocab, [])


def model_folder(dummy: str, vocab: int, vocab_file: str | None = None) -> str:
    """The dummy config beside a tokenizer: `vocab_file`'s tokens (tiktoken format), or
    a random byte-level BPE of `vocab` tokens (within the config's vocabulary size)."""
    folder = tempfile.mkdtemp(prefix="structured_bench_")
    for name in os.listdir(os.path.join(HERE, DUMMY_CONFIGS[dummy])):
        shutil.copy(os.path.join(HERE, DUMMY_CONFIGS[dummy], name), folder)
    with open(os.path.join(folder, "config.json")) as f:
        size = json.load(f)["vocab_size"]
    if vocab_file:
        tiktoken_bpe(folder, vocab_file)
    else:
        byte_level_bpe(folder, min(vocab, size - len(SPECIALS)))
    return folder


def run(llm, prompts, max_tokens, constrained: bool) -> float:
    """Seconds of the timed generate (after a warm-up of the same kind)."""
    import torch

    from nanovllm import SamplingParams
    from nanovllm.sampling_params import StructuredOutputsParams

    extra = {"structured_outputs": StructuredOutputsParams(json=SCHEMA)} if constrained else {}
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=16, **extra), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, **extra) for n in max_tokens]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dummy", choices=sorted(DUMMY_CONFIGS), default="qwen3-0.6b")
    ap.add_argument("--vocab", type=int, default=151_643, help="regular tokens of the built tokenizer")
    ap.add_argument("--vocab-file", help="a tiktoken file of real tokens instead (qwen.tiktoken)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=2, help="timed runs of each kind, alternating")
    ap.add_argument("--json")
    args = ap.parse_args()
    from nanovllm import LLM

    t = time.perf_counter()
    folder = model_folder(args.dummy, args.vocab, args.vocab_file)
    print(f"tokenizer built in {time.perf_counter() - t:.1f} s", flush=True)
    llm = LLM(folder, load_format="dummy", max_model_len=4096)
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len, max_id=10000)
    out_tokens = sum(max_tokens)
    times = {"unconstrained": [], "json_schema": []}
    for _ in range(args.repeat):
        for kind in times:
            times[kind].append(run(llm, prompts, max_tokens, kind == "json_schema"))
            print(f"{kind}: {out_tokens / times[kind][-1]:,.0f} output tok/s", flush=True)
    best = {k: min(v) for k, v in times.items()}
    result = {"what": "bench workload, every request constrained by a JSON schema vs none; best of "
                      f"{args.repeat} alternating runs; tokenizer: "
                      + (f"the tokens of {os.path.basename(args.vocab_file)}" if args.vocab_file
                         else f"byte-level BPE of {args.vocab} tokens built here"),
              "output_tok_s": {k: round(out_tokens / s, 1) for k, s in best.items()},
              "ratio_to_unconstrained": round(best["unconstrained"] / best["json_schema"], 3),
              "seconds": times}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    llm.shutdown()


if __name__ == "__main__":
    main()
