"""How many variants of Triton kernels this process has compiled, read from Triton's own caches
(per device; the first item of each entry maps compile keys to kernels): the GPU tests that
check nothing compiles inside a run count with it."""


def compiled_variants(*kernels) -> int:
    return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())


def forget_compiled(*kernels) -> None:
    """Empty these kernels' in-process caches, so that a count starts from none whichever tests
    ran before in the process (the next launch takes each variant from Triton's disk cache)."""
    for k in kernels:
        for entry in k.device_caches.values():
            entry[0].clear()
