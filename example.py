"""Chat with a Qwen3 checkpoint through nano-vllm.

    python example.py --model /path/to/Qwen3-0.6B

`--model` is a local checkpoint folder (config.json, *.safetensors, tokenizer files) or a Hub id
that is downloaded when the machine is online.
"""

import argparse
import os
import sys

from nanovllm import LLM, SamplingParams


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.expanduser("~/huggingface/Qwen3-0.6B"),
                        help="checkpoint folder or Hub id (default: ~/huggingface/Qwen3-0.6B, else Qwen/Qwen3-0.6B)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs)")
    args = parser.parse_args(argv)

    model = args.model
    if not os.path.isdir(model) and model == parser.get_default("model"):
        model = "Qwen/Qwen3-0.6B"
    try:
        llm = LLM(model, enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")

    questions = ["introduce yourself", "list all prime numbers within 100"]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    with llm:
        outputs = llm.chat(conversations, params, enable_thinking=False)
    for question, out in zip(questions, outputs):
        print(f"\nQ: {question!r}\nA: {out['text']!r}  [{out['finish_reason']}]")


if __name__ == "__main__":
    main()
