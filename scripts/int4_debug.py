import os, sys, torch
sys.path.insert(0, "tests")
import tiny_model as tm
from int4_checkpoints import quantized_checkpoint
from nanovllm import LLM
from nanovllm.features.quantization.int4_formats import dequantize
from nanovllm.kernels.w4a16 import w4a16_matmul
import tempfile, pathlib
root = pathlib.Path(tempfile.mkdtemp())
base = tm.make_tiny_qwen3(root / "b", hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=64,
                          intermediate_size=512, dtype=torch.bfloat16, max_position_embeddings=2048)
seq = torch.randint(0, 500, (200,), generator=torch.Generator().manual_seed(2)).tolist()
for case in (("gptq", 64, True, False), ("gptq_v2", 64, False, True), ("awq", 128, False, False), ("gptq", 64, True, False, "f32")):
    fmt, group, sym, act = case[:4]
    int4, dense = quantized_checkpoint(base, root / ("_".join(map(str, case))), fmt, group, sym, act)
    dt = "float32" if len(case) > 4 else "auto"
    res = {}
    for path in (int4, dense):
        llm = LLM(path, kvcache_block_size=16, max_model_len=1024, dtype=dt, enforce_eager=True)
        res[path] = llm.model_runner.score(seq)
        if path == int4:
            lay = llm.model_runner.model.model.layers[0].self_attn.qkv_proj
            w = lay.int4
            x = torch.randn(5, w.qweight.shape[0] * 8, device="cuda").to(w.scales.dtype)
            xp = x if w.perm is None else x.index_select(-1, w.perm)
            ker = w4a16_matmul(xp, w.qweight, w.scales, w.zeros, w.group_size).float()
            ref = xp.float() @ dequantize(w)
            cpu = dequantize(type(w)(w.qweight.cpu(), w.scales.cpu(), w.zeros.cpu(), w.group_size, None))
            print(case, "kernel vs torch", ((ker - ref).abs().max() / ref.abs().max()).item(),
                  "gpu vs cpu dequant", (dequantize(w).cpu() - cpu).abs().max().item(),
                  "perm", None if w.perm is None else w.perm[:8].tolist(), flush=True)
        llm.shutdown()
    a, b = res[int4], res[dense]
    print(case, "score rel err", ((a - b).norm() / b.norm()).item(), flush=True)
