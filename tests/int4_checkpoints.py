"""INT4 checkpoints made in the tests: tiny float weights quantized in groups (min / max, round to
nearest) and packed by this module's own packers, written from each format's description (GPTQ
v1 / v2 with and without an activation order, AWQ's interleaved nibbles, compressed-tensors'
pack-quantized, symmetric and not), beside a 16-bit copy holding the dequantized weights."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

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
    orders = {}  # projections of one input share its activation order (as GPTQ's, from the input's Hessian)
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        w = tensors[name].float()
        shared = name.rsplit(".", 2)[0] + {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(
            name.split(".")[-2], name.split(".")[-2])
        if act_order and shared not in orders:
            orders[shared] = torch.randperm(w.shape[1], generator=gen)
        order = orders.get(shared)
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


def logit_errors_on_gpu(int4: str, dense: str, seq: list[int]) -> dict[str, float]:
    """The INT4 engine's and the 16-bit engine's teacher-forced logits on `seq` against the fp32
    engine on the dequantized checkpoint (relative norms), CUDA graphs on; the INT4 engine also
    decodes 16 greedy tokens."""
    from nanovllm import LLM, SamplingParams

    logits = {}
    for name, path, dtype in (("int4", int4, None), ("dense", dense, None), ("fp32", dense, "float32")):
        llm = LLM(path, kvcache_block_size=16, max_model_len=1024, **({"dtype": dtype} if dtype else {}))
        logits[name] = llm.model_runner.score(seq).float()
        if name == "int4":
            out = llm.generate([seq[:20]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)
            assert len(out[0]["token_ids"]) == 16
        llm.shutdown()
    return {k: ((logits[k] - logits["fp32"]).norm() / logits["fp32"].norm()).item() for k in ("int4", "dense")}
