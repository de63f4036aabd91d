"""`python -m nanovllm.serve MODEL [options]`: the OpenAI-compatible server (serve/server.py)."""

from nanovllm.serve.server import main

if __name__ == "__main__":
    raise SystemExit(main())
