"""FP8 KV cache: the scales calibrated on the first prefill (`calculate_kv_scales=True`; the
`kv_cache_dtype` names are Config's). The cache's format (e4m3 values times one fp32 scale per layer
for K and for V) is the attention's: nanovllm/model/attention/fp8_cache.py and the kernels.

Calibration: scale = amax / R, so the calibrating prefill's largest |K| is stored as R (of
e4m3's 448) and later tokens may be 448 / R times larger before they saturate. One prefill is a
small sample (other prompts and later positions can exceed its amax), and a saturated value's
error is unbounded, while a smaller R is nearly free: e4m3's relative rounding (<= 2**-4) is the
same at every magnitude down to its smallest normal 2**-6, so only values below
amax * 2**-6 / R lose precision, and they add at most that fraction of amax to a dot product.

R is itself an e4m3 value, halfway between the rounding midpoints on either side: 192 = 1.5 *
2**7 (midpoints 184 and 200) for K, 96 for V (92, 100). amax / scale gives R back only up to an
fp32 rounding, and K / V carry noise of that order from the batch they were computed in (GEMM
shapes), so an R on a midpoint (vLLM's 200 and 100 are) would store the prompt's largest value
one e4m3 step up or down by chance: the same prompt would give other tokens alone and in a
batch. Headroom 448 / R: 2.3x for K, 4.7x for V, about vLLM's.
"""

from __future__ import annotations

import torch

K_SCALE_HEADROOM = 192.0
V_SCALE_HEADROOM = 96.0


@torch.no_grad()
def calibrate_kv_scales(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """k_scale = amax|k| / K_SCALE_HEADROOM, v_scale = amax|v| / V_SCALE_HEADROOM, computed and
    written on the device (no host sync): the attention layer's KVScaleCalibrator. An all-zero
    or non-finite amax gives a scale of 1.0 instead (dividing by 0 would turn every stored value
    into NaN)."""
    for x, buf, headroom in ((k, k_scale, K_SCALE_HEADROOM), (v, v_scale, V_SCALE_HEADROOM)):
        s = x.abs().amax().float().reshape(1) / headroom
        buf.copy_(torch.where(torch.isfinite(s) & (s > 0), s, 1.0))
