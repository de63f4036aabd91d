"""The sampler's CUDA route: noise, masking and argmax as fused Triton kernels instead of torch
ops over [B, V] temporaries (kernels/sampling.py, kernels/top_p.py). A CUDA engine's model runner
uses `TritonSampler`; a CPU one never loads this module (core/cuda_runtime.py)."""

from __future__ import annotations

import itertools

import torch

try:
    import triton

    from nanovllm.kernels.sampling import gumbel_argmax_triton
    from nanovllm.kernels.top_p import filtered_sample_triton
except ImportError:  # Triton only ships for Linux; the torch route covers the rest
    triton = None

from nanovllm.core.random_draw import _kth_threshold, _thresholds
from nanovllm.core.sampler import Sampler, SamplingTensors, _scaled


def _use_triton(x: torch.Tensor) -> bool:
    """Whether TritonSampler draws x's tokens with the fused Triton kernels rather than torch ops."""
    return x.is_cuda and triton is not None


def _wide_top_k(logits: torch.Tensor, t: SamplingTensors) -> bool:
    """Whether some row's top_k spans so much of the vocabulary that a full sort beats a
    partial torch.topk for its threshold."""
    vocab = logits.shape[-1]
    return t.need_top_k and max(1, min(t.max_top_k, vocab)) * 8 > vocab


def _fuse_scaling(logits: torch.Tensor, t: SamplingTensors, suppress) -> bool:
    """Whether the Triton kernels read the raw logits and divide them by the temperature
    themselves, which skips _scaled's fp32 [B, V] copy: unless tokens are suppressed, a row is
    not one unit-stride run, or a wide top-k needs the sorting thresholds."""
    return (_use_triton(logits) and logits.stride(-1) == 1 and suppress is None
            and not _wide_top_k(logits, t))


class TritonSampler(Sampler):
    """Sampler whose non-greedy draws of CUDA logits run as fused kernels (_sample_triton). It
    computes the same integer hash as the torch route, so both agree except where float rounding
    of log() flips a near-tie, or of the probability mass sums moves a token across top-p's cut."""

    @torch.inference_mode()
    def warm_up(self, vocab: int, dtypes, device) -> None:
        """Compile (CUDA) each Triton variant forward can launch for logits of `vocab` columns in
        `dtypes`, so that none compiles inside a user's run (a second or more each, cold): raw
        logits, suppressed tokens (a scaled copy), a wide top-k (sorted thresholds), with and
        without filters (which the filter kernels take as runtime values: a few variants)."""
        if not _use_triton(torch.empty(0, device=device)):
            return
        cases = ([(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0)], [(0.8, 5, 0.9, 0.05), (0.0, 0, 1.0, 0.0)],
                 [(1.0, vocab, 0.9, 0.0), (0.0, 0, 1.0, 0.0)])  # rows of (temperature, top_k, top_p, min_p)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        for dtype, case, suppress in itertools.product(dtypes, cases, (None, (zero, zero))):
            t = SamplingTensors.from_lists(*map(list, zip(*case)), [0, 0], [1, 1], device)
            self(torch.randn(2, vocab, device=device).to(dtype), t, suppress)

    def forward(self, logits: torch.Tensor, t: SamplingTensors,
                suppress: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if t.all_greedy or not _use_triton(logits):
            return super().forward(logits, t, suppress)
        return self._sample_triton(logits, t, suppress)

    def _sample_triton(self, logits: torch.Tensor, t: SamplingTensors, suppress) -> torch.Tensor:
        """Raw logits, no filters and no greedy row: gumbel_argmax_triton. Else filtered_sample_triton,
        which finds top-p's token without sorting (kernels/top_p.py), with top-k's threshold
        from a partial torch.topk on the raw logits; a top-k over most of the vocabulary takes
        every threshold from one sort (_thresholds) and masks in gumbel_argmax_triton."""
        x, scale = logits, _fuse_scaling(logits, t, suppress)
        if not scale:
            x = _scaled(logits, t, suppress)
        if scale and not (t.any_greedy or t.filters):
            return gumbel_argmax_triton(x, None, t.seeds, t.offsets, t.temperatures)
        if _wide_top_k(logits, t):
            thr, argmax = _thresholds(x, t)
            sampled = gumbel_argmax_triton(x, thr, t.seeds, t.offsets)
            return torch.where(t.temperatures == 0, argmax, sampled) if t.any_greedy else sampled
        thr = None
        if t.need_top_k:
            # On the raw logits: x -> x / T (correctly rounded, T > 0) never reverses an order, so
            # the k-th largest of the scores is the k-th largest logit divided by T, which is
            # what the kernel compares the scores with. Holds for fp32 too, where division may
            # merge neighbours: the tokens tied with the threshold after division are kept.
            width = max(1, min(t.max_top_k, x.shape[-1]))
            thr = _kth_threshold(torch.topk(x, width, dim=-1).values, t, width)
        return filtered_sample_triton(x, t.temperatures, thr, t.top_ps if t.need_top_p else None,
                                      torch.log(t.min_ps) if t.need_min_p else None, t.seeds, t.offsets,
                                      scale=scale)
