"""DecoderAttention's fused q/k norm + RoPE path (model/fused_qk_norm_rope.py: CUDA only in an
engine; here through Triton's interpreter, tests/conftest.py) against its plain-torch path: the
same attention output and the same K/V written into the paged cache (by the kernel itself)."""

from __future__ import annotations

import pytest
import torch

from nanovllm.model.attention import prefill_metadata
from nanovllm.model.attention.torch_backend import TorchBackend
from nanovllm.model.decoder import DecoderAttention, DecoderOptions
from nanovllm.model.layers.rotary_embedding import RotaryEmbedding


@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_path_matches_the_plain_one(fresh_seed, qk_norm):
    opts = DecoderOptions(vocab_size=32, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                          intermediate_size=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                          qk_norm=qk_norm)
    layer = DecoderAttention(opts, RotaryEmbedding(16, 64, 10000.0))
    for p in layer.parameters():
        p.data.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    layer.attn.backend = TorchBackend()
    hidden, positions = torch.randn(8, 64), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    slots = torch.tensor([0, 1, 2, 3, 4, 8, 9, 10])
    block_tables = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    results = []
    for fused in (False, True):
        layer.use_kernels = fused
        layer.attn.k_cache, layer.attn.v_cache = torch.zeros(2, 4, 4, 2, 16)  # [blocks, block size, heads, dim]
        meta = prefill_metadata([5, 3], [5, 3], slots, block_tables, "cpu")
        results.append((layer(positions, hidden, meta), layer.attn.k_cache, layer.attn.v_cache))
    for plain, fused in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    from nanovllm.model.fused_qk_norm_rope import store_args

    assert set(store_args(layer.attn, meta)) == {"k_cache", "v_cache", "slot_mapping"}  # the kernel stored K/V
