"""Chat with a checkpoint through nano-vllm (Qwen3, Qwen2.5, Llama 3, Qwen3-MoE).

    python example.py --model /path/to/Qwen3-0.6B

`--model` is a local checkpoint folder (config.json, *.safetensors, tokenizer files) or a Hub id
that is downloaded when the machine is online. Qwen3's thinking is turned off where the chat
template has the switch (`enable_thinking`); other templates get no such keyword.
"""

import argparse
import os
import sys

from nanovllm import LLM, SamplingParams
from nanovllm.chat_template import template_variables


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
        run(model, args)
    except (FileNotFoundError, ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        sys.exit(f"error: {e}")


def run(model: str, args) -> None:
    llm = LLM(model, enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp)
    questions = ["introduce yourself", "list all prime numbers within 100"]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    reads = template_variables(llm.get_tokenizer().chat_template) or set()
    template_kwargs = {"enable_thinking": False} if "enable_thinking" in reads else {}
    with llm:
        outputs = llm.chat(conversations, params, chat_template_kwargs=template_kwargs)
    for question, out in zip(questions, outputs):
        print(f"\nQ: {question!r}\nA: {out.outputs[0].text!r}  [{out.outputs[0].finish_reason}]")


if __name__ == "__main__":
    main()
