"""A tensor-parallel worker process (ranks 1..N-1) and the process-group rendezvous.

The worker joins the process group, builds its ModelRunner shard, then runs what rank 0 sends
over its pipe, one `(method, args)` message per step, until told to exit. The rendezvous goes
through a fresh temporary file (no port or shared-memory name is hard-coded).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.core.hooks import ForwardStrategy
from nanovllm.core.model_runner import ModelRunner
from nanovllm.launch.supervisor import UNGUARDED_MAIN_EXIT_CODE
from nanovllm.parallel.create_group import create_tp_group
from nanovllm.parallel.group import TPGroup


def rendezvous(config: Config, rank: int, init_file: str) -> None:
    """Join the process group of `config.parallel.tensor_parallel_size` ranks (NCCL on GPUs, gloo on CPU).
    The caller has made GPU `rank` its current device (CUDA keeps that per thread)."""
    dist.init_process_group("nccl" if config.device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            world_size=config.parallel.tensor_parallel_size, rank=rank, timeout=timedelta(minutes=10))


def tp_group(config: Config) -> TPGroup:
    """This rank's tensor-parallel group, on its current device, once the process group is up.
    Collective: every rank calls it before building its ModelRunner."""
    device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")
    return create_tp_group(config.parallel.tensor_parallel_size, device, config.dtype, config.hf_config.hidden_size,
                           config.max_num_batched_tokens, config.parallel.custom_all_reduce)


def refuse_unguarded_main() -> None:
    """In a process that multiprocessing is still starting (it imports the caller's main script
    to find the worker function), an engine with worker processes of its own can only come from
    that script's module-level code: one without an `if __name__ == "__main__":` guard. Say so
    and exit with a code rank 0 recognises, instead of multiprocessing's bootstrap error."""
    if getattr(mp.current_process(), "_inheriting", False):
        print("nano-vllm: this spawned worker is re-running the main script's module-level code, which "
              "creates an LLM with worker processes; guard it with `if __name__ == \"__main__\":`",
              file=sys.stderr, flush=True)
        os._exit(UNGUARDED_MAIN_EXIT_CODE)


def _exit_with_parent(init_file: str) -> None:
    """End this worker when rank 0's process is gone, even if its main thread is stuck waiting
    for the GPU (say, in a fused all-reduce whose peer will never come): exiting frees the GPU.
    The rendezvous file rank 0 would have removed goes too."""
    parent = mp.parent_process()
    if parent is not None:
        parent.join()
        remove_quietly(init_file)
        os._exit(1)


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # already gone (rank 0 or another worker removed it)
        pass


def worker_main(config: Config, rank: int, init_file: str, forward_strategy: ForwardStrategy | None, conn) -> None:
    """Entry point of a spawned worker process (`forward_strategy`: rank 0's, not prepared yet)."""
    threading.Thread(target=_exit_with_parent, args=(init_file,), daemon=True, name="nanovllm-tp-parent-watch").start()
    try:
        conn.send(("joining", None))  # rank 0 joins the rendezvous only once every worker is alive
        if config.device == "cuda":
            torch.cuda.set_device(rank)
        rendezvous(config, rank, init_file)
        runner = ModelRunner(config, forward_strategy, tp_group(config))
        conn.send(("ready", runner.num_blocks))
        while True:
            method, args = conn.recv()
            if method == "exit":
                break
            getattr(runner, method)(*args)
    except EOFError:  # rank 0 went away: nothing left to serve, and nobody else removes the file
        remove_quietly(init_file)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
