"""INT4 weight-only checkpoints (features/quantization/int4*.py, kernels/w4a16.py) on CPU, float32.

The checkpoints are made here: random tiny Qwen3 weights quantized in groups (min / max, round
to nearest) and packed by this module's own packers, written from each format's description
(GPTQ v1 / v2 with and without an activation order, AWQ's interleaved nibbles, compressed-
tensors' pack-quantized, symmetric and not). The reference is transformers on the *dequantized*
weights: greedy tokens must be equal. The unpacking is also checked layer by layer against the
dequantized weights, and the Triton kernel (interpreter) against the same arithmetic in torch.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402
from helpers import greedy, make_llm, rand_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_NIBBLE_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column AWQ_NIBBLE_COLUMN[i]


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) as the int32 of the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> [R / 8, C]: row 8i + j of a column in bits 4j of word i."""
    q = q.long().reshape(q.shape[0] // 8, 8, q.shape[1])
    return to_int32(sum(q[:, j] << (4 * j) for j in range(8)))


def pack_cols(q: torch.Tensor, nibble_column=tuple(range(8))) -> torch.Tensor:
    """[R, C] values 0..15 -> [R, C / 8]: nibble i of word c holds column 8c + nibble_column[i]."""
    q = q.long().reshape(q.shape[0], q.shape[1] // 8, 8)
    return to_int32(sum(q[:, :, nibble_column[i]] << (4 * i) for i in range(8)))


def quantize(w: torch.Tensor, group: int, sym: bool, order: torch.Tensor | None = None):
    """w [out, in] -> (q [in, out] 0..15, z [groups, out], s [groups, out], each input feature's
    group, dequantized w [out, in]). Groups run over `order` (an activation order) if given."""
    out_f, in_f = w.shape
    group = in_f if group == -1 else group
    order = torch.arange(in_f) if order is None else order
    g_idx = torch.empty(in_f, dtype=torch.long)
    g_idx[order] = torch.arange(in_f) // group
    wt = w.t()  # [in, out]
    n_groups = in_f // group
    s, z = torch.empty(n_groups, out_f), torch.empty(n_groups, out_f)
    for g in range(n_groups):
        rows = wt[g_idx == g]
        if sym:
            s[g] = rows.abs().amax(0).clamp(min=1e-6) / 7.5
            z[g] = 8
        else:
            lo, hi = rows.amin(0), rows.amax(0)
            s[g] = ((hi - lo) / 15).clamp(min=1e-6)
            z[g] = torch.round(-lo / s[g]).clamp(0, 15)
    s = s.half().float()  # (the checkpoints store fp16 scales)
    q = torch.clamp(torch.round(wt / s[g_idx]) + z[g_idx], 0, 15)
    deq = ((q - z[g_idx]) * s[g_idx]).t().contiguous()
    return q.to(torch.int32), z, s, g_idx, deq


def encode(fmt: str, q, z, s, g_idx, sym: bool, act_order: bool) -> dict[str, torch.Tensor]:
    """One layer's stored tensors (names after the module prefix) in `fmt`."""
    if fmt in ("gptq", "gptq_v2"):
        return {"qweight": pack_rows(q), "qzeros": pack_cols((z - (1 if fmt == "gptq" else 0)).long()),
                "scales": s.half(), "g_idx": g_idx.to(torch.int32)}
    if fmt == "awq":
        return {"qweight": pack_cols(q, AWQ_NIBBLE_COLUMN), "qzeros": pack_cols(z.long(), AWQ_NIBBLE_COLUMN),
                "scales": s.half()}
    out = {"weight_packed": pack_cols(q.t()), "weight_scale": s.t().contiguous().half(),
           "weight_shape": torch.tensor([q.shape[1], q.shape[0]], dtype=torch.int64)}
    if not sym:  # stored + 8 from the signed range, i.e. z itself; packed along the output
        out["weight_zero_point"] = pack_rows(z.t().contiguous())
    if act_order:
        out["weight_g_idx"] = g_idx.to(torch.int32)
    return out


def quant_config(fmt: str, group: int, sym: bool, act_order: bool) -> dict:
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": act_order,
                "checkpoint_format": "gptq" if fmt == "gptq" else "gptq_v2"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group" if group > 0 else "channel",
               "group_size": group if group > 0 else None, "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}}


def quantized_checkpoint(src: str, dst, fmt: str, group: int, sym: bool, act_order: bool) -> tuple[str, str]:
    """(the INT4 checkpoint, a 16-bit copy holding its dequantized weights) of `src`."""
    import shutil

    tensors = load_file(os.path.join(src, "model.safetensors"))
    quant, deq = dict(tensors), dict(tensors)
    gen = torch.Generator().manual_seed(len(fmt) + group)
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        w = tensors[name].float()
        order = torch.randperm(w.shape[1], generator=gen) if act_order else None
        q, z, s, g_idx, d = quantize(w, group, sym, order)
        prefix = name[: -len(".weight")]
        del quant[name]
        quant.update({f"{prefix}.{k}": v for k, v in encode(fmt, q, z, s, g_idx, sym, act_order).items()})
        deq[name] = d
    paths = []
    for folder, weights, qc in ((dst / "int4", quant, quant_config(fmt, group, sym, act_order)),
                                (dst / "dequantized", deq, None)):
        shutil.copytree(src, folder)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
        if qc is not None:
            config = json.loads((folder / "config.json").read_text())
            config["quantization_config"] = qc
            (folder / "config.json").write_text(json.dumps(config))
        paths.append(str(folder))
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tm.make_tiny_qwen3(tmp_path_factory.mktemp("int4_base"), num_layers=2, seed=3)


CASES = [("gptq", 32, True, False), ("gptq_v2", 64, False, True), ("gptq", -1, True, False),
         ("awq", 32, False, False), ("compressed-tensors", 32, True, False),
         ("compressed-tensors", -1, False, False), ("compressed-tensors", 64, True, True)]


@pytest.mark.parametrize("fmt, group, sym, act_order", CASES)
def test_greedy_equals_transformers_on_the_dequantized_weights(base, tmp_path, fmt, group, sym, act_order):
    int4, dequantized = quantized_checkpoint(base, tmp_path, fmt, group, sym, act_order)
    llm = make_llm(int4)
    prompts = [rand_ids(9, 1), rand_ids(23, 2)]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    hf = tm.load_hf_model(dequantized)
    assert got == [tm.hf_greedy(hf, p, 12) for p in prompts]
    # Layer by layer: the kernels' layout dequantizes to the checkpoint's values exactly.
    from nanovllm.features.quantization.int4_formats import dequantize

    layer = llm.model_runner.model.model.layers[0].mlp.down_proj
    w = dequantize(layer.int4)
    if layer.int4.perm is not None:
        w = w[torch.argsort(layer.int4.perm)]
    want = hf.model.layers[0].mlp.down_proj.weight.detach().t()
    assert torch.allclose(w, want, atol=1e-6, rtol=1e-5), (w - want).abs().max()


@pytest.mark.parametrize("m, group", [(1, 64), (5, 32), (70, 128)])
def test_the_kernel_equals_its_torch_arithmetic(m, group):
    """kernels/w4a16.py under the Triton interpreter (fp32): split-K with atomic sums at small M,
    plain tiles above 64 rows. The same products summed in another order: within 1e-4."""
    from nanovllm.features.quantization.int4_formats import Int4Weights, dequantize
    from nanovllm.kernels.w4a16 import w4a16_matmul

    k, n = 256, 96
    g = torch.Generator().manual_seed(m)
    w = Int4Weights(torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g).to(torch.int32),
                    torch.rand(k // group, n, generator=g) * 0.01, torch.randint(0, 16, (k // group, n), generator=g)
                    .float(), group, None)
    x = torch.randn(m, k, generator=g)
    got = w4a16_matmul(x, w.qweight, w.scales, w.zeros, group)
    want = x @ dequantize(w)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("qc, error, match", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, ValueError, "bits=8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, ValueError, "group_size=48"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}, ValueError, "marlin"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False}, ValueError, "zero_point"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, ValueError, "gemv"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}}, ValueError,
     "pack-quantized"),
])
def test_unsupported_settings_are_refused_before_loading(base, tmp_path, qc, error, match):
    import shutil

    folder = tmp_path / "q"
    shutil.copytree(base, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=match):
        make_llm(str(folder))


def test_act_order_with_tensor_parallelism_and_moe_are_refused(base, tmp_path):
    int4, _ = quantized_checkpoint(base, tmp_path, "gptq_v2", 64, False, True)
    with pytest.raises(ValueError, match="activation order"):
        make_llm(int4, tensor_parallel_size=2)
    moe = tm.make_tiny_qwen3_moe(tmp_path / "moe")
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        make_llm(moe, quantization="gptq", load_format="dummy")
