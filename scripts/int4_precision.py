"""Where INT4 batch-1 decode parts from transformers on a tiny GPTQ Qwen3 (GPU diagnostic).

tests/test_int4.py's batch-1 GPU test compares our greedy tokens with transformers in bf16 on the
dequantized weights. Our engine keeps the checkpoint's fp16 scales as bf16 (the model's dtype)
and multiplies the unrounded (q - z) * s in fp32; transformers rounds each dequantized weight to
bf16. Both are bf16-accurate, so where they part should be a near-tie of the exact model. This
prints, per prompt, the greedy tokens of: ours, transformers bf16, transformers fp32 on the exact
dequantized weights (fp16 scales) and on those with bf16 scales (our arithmetic), and the logit
margins at the first divergence under each fp32 reference, with transformers bf16's own distance
from fp32 (teacher-forced along its tokens) as the yardstick.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_model as tm  # noqa: E402
from int4_checkpoints import LINEARS, quantize, quantized_checkpoint  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def logits_along(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq], device=DEV)).logits[0].float()


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def bf16_scale_weights(model, src):
    """Overwrite model's linear weights with (q - z) * s where s is rounded to bf16 (our arithmetic)."""
    tensors = load_file(str(Path(src) / "model.safetensors"))
    params = dict(model.named_parameters())
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        q, z, s, g_idx, _ = quantize(tensors[name].float(), 128, True)
        deq = ((q.float() - z[g_idx]) * s.bfloat16().float()[g_idx]).t()
        params[name].data.copy_(deq.to(params[name].device, params[name].dtype))


def main():
    tmp = Path(tempfile.mkdtemp())
    src = tm.make_tiny_qwen3(tmp / "m", hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2,
                             head_dim=64, intermediate_size=512, dtype=torch.bfloat16)
    int4, dense = quantized_checkpoint(src, tmp, "gptq", 128, True, False)
    hf16 = tm.load_hf_model(dense, dtype=torch.bfloat16, device=DEV)
    exact = tm.load_hf_model(dense, dtype=torch.float32, device=DEV)
    ours_arith = tm.load_hf_model(dense, dtype=torch.float32, device=DEV)
    bf16_scale_weights(ours_arith, src)
    llm = LLM(int4, max_model_len=512)
    gen = torch.Generator().manual_seed(3)
    for n in (1, 40):
        prompt = torch.randint(0, 500, (n,), generator=gen).tolist()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)[0]
        ours = list(out.outputs[0].token_ids)
        seqs = {"hf bf16": tm.hf_greedy(hf16, prompt, 24), "fp32 exact": tm.hf_greedy(exact, prompt, 24),
                "fp32 bf16-scales": tm.hf_greedy(ours_arith, prompt, 24)}
        print(f"prompt {n}: ours {ours[:8]}...")
        for k, v in seqs.items():
            print(f"  {k:<18} first differs from ours at {first_diff(ours, v)}")
        ref = seqs["hf bf16"]
        dev = (logits_along(hf16, prompt + ref) - logits_along(exact, prompt + ref)).abs().max(-1).values
        print(f"  hf bf16 vs fp32 exact, teacher-forced: max |dlogit| {dev.max().item():.4f} "
              f"(median {dev.median().item():.4f})")
        i = first_diff(ours, ref)
        if i is None:
            continue
        for name, model in (("hf bf16", hf16), ("fp32 exact", exact), ("fp32 bf16-scales", ours_arith)):
            lg = logits_along(model, prompt + ref[:i])[-1]
            top2 = lg.topk(2)
            print(f"  at {i} under {name:<18}: logit[ref {ref[i]}] - logit[ours {ours[i]}] = "
                  f"{(lg[ref[i]] - lg[ours[i]]).item():+.4f}; top-2 margin {(top2.values[0] - top2.values[1]).item():.4f}"
                  f"; max |logit| {lg.abs().max().item():.2f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
