"""What the compressed-tensors library itself writes (llm-compressor's W4A16 `pack-quantized`)
loads and decodes like transformers on the library's own decompression of it: an independent
packer and dequantizer for the format (tests/int4_checkpoints.py is ours, written from its
description)."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402
from helpers import greedy, make_llm, rand_ids  # noqa: E402

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,  # noqa: E402
                                             apply_quantization_config)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def compress_with_the_library(model, folder, symmetric: bool, group: int | None) -> None:
    """Min / max scales from the library's calculate_qparams for every decoder Linear, then its
    ModelCompressor packs them ("pack-quantized") and writes config.json's quantization_config."""
    strategy = "group" if group else "channel"
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            w = w.reshape(w.shape[0], -1, group or w.shape[1])
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            module.weight_scale.data.copy_(scale)
            module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)


@pytest.mark.parametrize("symmetric, group", [(False, 32), (True, None)])
def test_what_compressed_tensors_writes_decodes_like_its_decompression(tmp_path, symmetric, group):
    base = tm.make_tiny_qwen3(tmp_path / "base", num_layers=2, seed=7)
    model = tm.load_hf_model(base)
    folder = tmp_path / "w4a16"
    compress_with_the_library(model, str(folder), symmetric, group)
    for name in os.listdir(base):  # the tokenizer (save_pretrained writes the model only)
        if not (folder / name).exists():
            shutil.copy(os.path.join(base, name), folder / name)
    llm = make_llm(str(folder))
    prompts = [rand_ids(9, 1), rand_ids(23, 2)]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    # The compressed model decompresses itself on its first forward: the library's dequantization.
    want = [tm.hf_greedy(model, p, 12) for p in prompts]
    assert got == want
    layer = llm.model_runner.model.model.layers[1].mlp.down_proj
    from nanovllm.features.quantization.int4_formats import dequantize

    assert torch.allclose(dequantize(layer.int4).t(), model.model.layers[1].mlp.down_proj.weight.detach().float(),
                          atol=1e-6, rtol=1e-5)
