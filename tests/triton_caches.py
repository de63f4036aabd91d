"""How many variants of Triton kernels this process has compiled, read from Triton's own caches
(per device; the first item of each entry maps compile keys to kernels): the GPU tests that
check nothing compiles inside a run count with it."""


def compiled_variants(*kernels) -> int:
    return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())
