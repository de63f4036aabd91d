"""How many variants of Triton kernels this process has compiled, read from Triton's own caches
(per device; the first item of each entry maps compile keys to kernels): the GPU tests that
check nothing compiles inside a run count with it; and the compile keys of caught launches, for
the CPU tests that check a warm-up covers every variant a run launches."""

import json
import os
import subprocess
import sys

import torch

import hopper_compile


def compiled_variants(*kernels) -> int:
    return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())


def forget_compiled(*kernels) -> None:
    """Empty these kernels' in-process caches, so that a count starts from none whichever tests
    ran before in the process (the next launch takes each variant from Triton's disk cache)."""
    for k in kernels:
        for entry in k.device_caches.values():
            entry[0].clear()


def compile_keys(fn) -> set:
    """The compile keys of the Triton launches fn() makes (caught, not run)."""
    keys = set()
    for kernel, named, _ in hopper_compile.capture_launches(fn):
        plain = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
        any_align = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize_on_alignment}
        key = [kernel.fn.__name__]
        for p in kernel.params:
            v = named.get(p.name)
            if p.is_constexpr:
                key.append((p.name, v))
            elif isinstance(v, torch.Tensor):  # and whether its address is 16-byte aligned, as Triton specializes
                key.append((p.name, v.dtype, p.name in any_align or v.data_ptr() % 16 == 0))
            elif isinstance(v, int) and not isinstance(v, bool) and p.name not in plain:
                key.append((p.name, "1" if v == 1 else "16k" if v % 16 == 0 else "n"))
        keys.add((key[0], repr(key[1:])))
    return keys


def json_without_interpreter(script: str, *args: str):
    """The JSON that `script` prints last, run as `python -c` (argv: this folder, then `args`) in
    a process without TRITON_INTERPRET: conftest turns the interpreter on, and compile_keys can
    catch launches only without it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script, os.path.dirname(os.path.abspath(__file__)), *args],
                          env=env, capture_output=True, text=True, timeout=300, cwd=hopper_compile.ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
