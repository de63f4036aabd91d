"""`python -m nanovllm.serve MODEL [options]`: the OpenAI-compatible server (serve/cli.py)."""

from nanovllm.serve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
