"""How many variants of Triton kernels this process has compiled, read from Triton's own caches
(per device; the first item of each entry maps compile keys to kernels): the GPU tests that
check nothing compiles inside a run count with it; and the compile keys of caught launches, for
the CPU tests that check a warm-up covers every variant a run launches."""

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
