"""`python -m nanovllm.serve MODEL [options]`: the OpenAI-compatible server's command line.

    pip install -e ".[server]"
    python -m nanovllm.serve /path/to/Qwen3-0.6B --port 8000
    # then any OpenAI client: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")

Every `LLM` option is a flag, made from nanovllm/config.py's Config fields (a new option is a
new flag); the server turns mixed steps on by default (decode rows ride along with prompt
chunks, so running streams keep flowing while a long prompt prefills). The engine runs in a
process of its own (engine_process.py), requests are prepared (tokenized, templated, checked) in
preparer workers (preparer_pool.py), and this process serves HTTP (app.py), so that none of the
three waits for another's GIL. A client that disconnects has its request aborted and its blocks
freed. When the engine dies, the server exits with code 1 (a supervisor restarts it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

from nanovllm.cli_options import add_option_flags, option_names, option_values
from nanovllm.config import wants_data_parallel
from nanovllm.feature_options import LoraConfig
from nanovllm.features.reasoning import PARSERS as REASONING_PARSERS
from nanovllm.features.tools.parsers import PARSERS
from nanovllm.serve.app import create_app
from nanovllm.serve.async_engine import SINGLE_ENGINE_ONLY
from nanovllm.serve.engine_process import EngineProcess
from nanovllm.serve.http_server import DrainingServer, listen_socket, uvicorn_config
from nanovllm.serve.lora_modules import LoraModules, parse_lora_module
from nanovllm.serve.preparer_pool import PreparerPool
from nanovllm.serve.routes import ServeOptions

logger = logging.getLogger("nanovllm.serve")

# Help for each LLM option (docs/api.md's option table); an option without an entry here still
# gets its flag, with a pointer to docs/api.md.
OPTION_HELP = {
    "tensor_parallel_size": "GPUs to split the model over",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step; longer prompts are prefilled in chunks",
    "max_model_len": "longest prompt + output (clamped to the model's max_position_embeddings)",
    "gpu_memory_utilization": "share of the GPU this engine may use",
    "kvcache_block_size": "tokens per KV block (a power of two >= 16)",
    "num_kvcache_blocks": "> 0: exactly that many KV blocks (else sized from memory)",
    "enforce_eager": "no CUDA graphs",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "device": "'cuda' or 'cpu' (default: cuda when available)",
    "dtype": "bfloat16 / float16 / float32 (default: the checkpoint's on CUDA, float32 on CPU)",
    "load_format": "'auto' or 'dummy' (random weights from config.json)",
    "seed": "seeds requests that have no seed of their own",
    "skip_tokenizer_init": "no tokenizer: prompts must be token ids, text is empty",
    "attention_backend": "force 'flash_attn', 'triton' or 'torch'",
    "custom_all_reduce": "fused symmetric-memory all-reduces under tensor parallelism",
    "tokenizer": "a different tokenizer folder (or Hub id) than the model's",
    "tokenizer_mode": "'auto' or 'slow'",
    "trust_remote_code": "passed to transformers when loading the tokenizer",
    "revision": "the Hub revision of a model or tokenizer given as a Hub id",
    "max_logprobs": "the most logprobs a request may ask for (-1: the whole vocabulary)",
    "generation_config": "default sampling parameters: 'auto' (the model's), 'vllm' (none) or a folder",
    "kv_cache_dtype": "'auto' or 'fp8'",
    "calculate_kv_scales": "calibrate the FP8 KV cache's scales on the first prefill",
    "quantization": "None or 'fp8' (FP8 checkpoints are detected by themselves)",
    "mixed_steps": "decode rows ride along with prompt chunks in one step (the server's default: on)",
    "max_prefill_graph_tokens": "prefill-shaped steps of up to this many tokens replay piecewise CUDA graphs (0: none)",
}
SERVER_DEFAULTS = {"mixed_steps": True}


def config_fields() -> dict[str, tuple[object, object]]:
    """The LLM options but `model`: name -> (type, default) (cli_options.option_names)."""
    return option_names()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.serve", description="An OpenAI-compatible server "
                                     "on nano-vllm's engine.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("model", help="a local checkpoint folder (or a Hub id when online)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL)")
    parser.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY") or None,
                        help="clients must send `Authorization: Bearer KEY` (every route but /health and /metrics); "
                             "default: $NANOVLLM_API_KEY, else no key")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--step-log", default=None, metavar="PATH",
                        help="write one JSON line per engine step to PATH (its kind, tokens, rows, when it ended, "
                             "how long the host waited for it): where serving latency goes")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds open responses may run on after SIGTERM before they are cancelled")
    _add_request_flags(parser.add_argument_group("requests"))
    _add_connection_flags(parser.add_argument_group("connections"))
    _add_llm_flags(parser.add_argument_group("LLM options (nanovllm.LLM's keyword arguments)"))
    return parser


def _add_request_flags(group) -> None:
    defaults = ServeOptions()
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="render chat templates that requests send (`chat_template`, or in chat_template_kwargs): "
                            "code the server runs, refused (400) unless the clients are trusted")
    group.add_argument("--preparer-workers", type=int, default=2,
                       help="processes that prepare requests (chat template, tokenizing, checks) off the engine")
    group.add_argument("--prepare-timeout", type=float, default=10.0,
                       help="seconds a request's preparation may take; longer is a 400, and its worker is replaced")
    group.add_argument("--engine-stall-timeout", type=float, default=defaults.engine_stall_s,
                       help="/health answers 503 once the engine has been silent, or has made no progress with "
                            "requests in it, this many seconds")
    group.add_argument("--max-request-body-bytes", type=int, default=defaults.max_body_bytes,
                       help="the largest request body (larger: 413)")
    group.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=defaults.tool_call_parser,
                       help="how tool calls are read out of the text with tool_choice 'auto'")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="vLLM's flag, accepted: tool_choice 'auto' is always on here")
    group.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                       help="split the model's reasoning (<think> ... </think>) into reasoning_content")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters to serve as models (with --enable-lora): name=path, or JSON "
                            "{\"name\": ..., \"path\": ...}; more come through POST /v1/load_lora_adapter")


def _add_connection_flags(group) -> None:
    group.add_argument("--request-header-timeout", type=float, default=10.0,
                       help="seconds a connection may take to send a request's head (then it is closed)")
    group.add_argument("--request-body-timeout", type=float, default=ServeOptions().body_timeout_s,
                       help="seconds a request's body may take to arrive after its head (then 408)")
    group.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="seconds an idle keep-alive connection is kept open")
    group.add_argument("--limit-concurrency", type=int, default=None,
                       help="most connections and requests at once; past it, new requests get 503 "
                            "(default: half the open-file limit)")


def _add_llm_flags(group) -> None:
    add_option_flags(group, SERVER_DEFAULTS, OPTION_HELP)


def llm_options(args: argparse.Namespace) -> dict:
    """The LLM keyword arguments the flags give (the server's defaults for those not given)."""
    return {**SERVER_DEFAULTS, **option_values(args)}


def _lora_modules(args: argparse.Namespace, options: dict) -> LoraModules:
    """The adapters of --lora-modules, checked (the LoRA options as the engine gets them)."""
    return LoraModules(args.served_model_name or args.model, bool(options.get("enable_lora")),
                       [parse_lora_module(m) for m in args.lora_modules],
                       options.get("max_lora_rank", LoraConfig.max_lora_rank))


def serve_options(args: argparse.Namespace, options: dict) -> ServeOptions:
    return ServeOptions(trust_request_chat_template=args.trust_request_chat_template,
                        engine_stall_s=args.engine_stall_timeout, max_body_bytes=args.max_request_body_bytes,
                        body_timeout_s=args.request_body_timeout, tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser, enable_lora=bool(options.get("enable_lora")),
                        max_lora_rank=options.get("max_lora_rank", LoraConfig.max_lora_rank),
                        lora_modules=tuple(parse_lora_module(m) for m in args.lora_modules))


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """The flags and the LLM options, refused before any work when they cannot serve."""
    parser = build_parser()
    args = parser.parse_args(argv)
    options = llm_options(args)
    if wants_data_parallel(options):  # before any replica starts, not when the app does
        parser.error(SINGLE_ENGINE_ONLY)
    if args.api_key is not None:
        args.api_key = args.api_key.strip()  # (a key read from a file often ends in a newline)
        if not args.api_key:
            parser.error("--api-key must not be empty (leave it out for no key)")
    if args.preparer_workers < 1:
        parser.error("--preparer-workers must be at least 1")
    try:
        _lora_modules(args, options)
    except (ValueError, FileNotFoundError) as e:  # (before the model loads)
        parser.error(str(e))
    return args, options


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT / SIGTERM (exit code 0) or until the engine dies (exit code 1)."""
    args, options = _parse(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pool = PreparerPool(args.preparer_workers, args.prepare_timeout)
    pool.spawn()  # (the workers import while the model loads)
    engine = EngineProcess(args.model, options, log_level=args.log_level.upper(), step_log=args.step_log)
    try:
        engine.start()  # the model loads in the engine's process (its error, if it cannot, is raised here)
        pool.start(engine.info.preparer)
        sock = listen_socket(args.host, args.port)
        host, port = sock.getsockname()[:2]
        name = args.served_model_name or args.model
        app = create_app(engine, name, args.api_key, pool, serve_options(args, options))
        config = uvicorn_config(app, args.log_level, args.shutdown_timeout, args.request_header_timeout,
                                args.timeout_keep_alive, args.limit_concurrency)
        server = DrainingServer(config, engine, args.shutdown_timeout)
        engine.on_death = pool.on_empty = server.engine_died
        if not engine.running:
            server.engine_died(engine.error)
            return 1
        # uvicorn takes SIGINT / SIGTERM while it runs and, once it has shut down, raises the
        # signal again under the handler that was there before: make that one a no-op, so a
        # SIGTERM ends the process normally (exit 0) after the clean shutdown below.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        print(f"nanovllm.serve: engine pid {engine.pid}", flush=True)
        print(f"nanovllm.serve: {name} on http://{host}:{port}", flush=True)
        server.run(sockets=[sock])
    finally:
        engine.stop()
        pool.stop()
    return 1 if server.died is not None else 0
