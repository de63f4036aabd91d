"""Tiny, locally generated checkpoints (Qwen3, Qwen2, Llama, Qwen3-MoE) and tokenizer for tests.

Nothing here touches the network: the tokenizer is a byte-level BPE trained in memory on a small
built-in corpus, and the model is a randomly initialised ``transformers`` model (``Qwen3ForCausalLM``
by default) saved as safetensors.  Everything is deterministic: the same arguments give the same files.

Public API
----------
- ``make_tokenizer(path) -> PreTrainedTokenizerFast``
- ``make_tiny_model(path, family="qwen3", *, vocab_size=None, hidden_size=64, ..., **family_options) -> str``
- ``make_tiny_qwen3`` / ``make_tiny_qwen3_moe(path, **kw) -> str``
- ``MODEL_CONFIGS``: named checkpoints of the other families; ``make_named(path, name, **overrides)``
- ``fuse_expert_tensors(path)`` / ``unfuse_expert_tensors(path)``: MoE expert tensor layouts
- ``rewrite_tensors(path, fn)``: replace a checkpoint's tensors with ``fn(tensors)``
- ``load_hf_model(path, dtype=torch.float32, device="cpu")``
- ``hf_greedy(model, prompt_ids, max_new_tokens) -> list[int]``
- ``CONFIGS``: named keyword sets for ``make_tiny_qwen3``
- ``tiny_qwen3_path(name="gqa", **overrides) -> str``: per-process cached checkpoint of ``CONFIGS[name]``
- ``SPECIAL_TOKENS`` / ``special_token_ids()``
"""

from __future__ import annotations

import atexit
import copy
import json
import re
import shutil
import tempfile
from pathlib import Path

import torch

__all__ = [
    "CHAT_TEMPLATE",
    "CONFIGS",
    "SPECIAL_TOKENS",
    "TOKENIZER_VOCAB_SIZE",
    "hf_greedy",
    "load_hf_model",
    "FAMILIES",
    "LLAMA3_ROPE_SCALING",
    "MODEL_CONFIGS",
    "fuse_expert_tensors",
    "make_named",
    "make_tiny_model",
    "make_tiny_qwen3",
    "make_tiny_qwen3_moe",
    "make_tokenizer",
    "unfuse_expert_tensors",
    "rewrite_tensors",
    "special_token_ids",
    "tiny_qwen3_path",
]

# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

# Size of the trained BPE vocabulary (256 byte symbols + merges); the special tokens come after.
_BPE_VOCAB_SIZE = 512

# Order matters: ids are _BPE_VOCAB_SIZE + index, like Qwen3 (151643, 151644, 151645, ...).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# <think>/</think> are added (never split) but not "special" in Qwen3: decode keeps them even
# with skip_special_tokens=True.
_TRULY_SPECIAL = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}

TOKENIZER_VOCAB_SIZE = _BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)  # len(tokenizer)


def special_token_ids() -> dict[str, int]:
    """Token ids of the special tokens (fixed by construction)."""
    return {tok: _BPE_VOCAB_SIZE + i for i, tok in enumerate(SPECIAL_TOKENS)}


# Qwen2/Qwen3 pre-tokenisation regex.
_QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Close to Qwen3's template (tool calling left out): system/user/assistant turns, reasoning kept only
# for assistant turns after the last user query, and the enable_thinking switch.
CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string"
    " and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}"
    "{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_CORPUS_EN = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you doing today?",
    "Large language models predict the next token given the previous tokens.",
    "The cache stores keys and values for every layer so decoding stays fast.",
    "Paged attention splits the key value cache into fixed size blocks.",
    "Please write a short poem about the sea, the moon and the stars.",
    "What is the capital of France? The capital of France is Paris.",
    "Once upon a time there was a little robot who wanted to learn to sing.",
    "Numbers like 0, 1, 2, 3, 42, 100, 2024 and 3.14159 appear in text too.",
    "I think, therefore I am. To be or not to be, that is the question.",
    "Introduce yourself in one sentence, then list three prime numbers.",
    "The weather today is sunny with a light breeze from the west.",
    "She said: \"It's fine, we'll fix it tomorrow\", and they'd agreed.",
    "Batching many requests together keeps the accelerator busy.",
]

_CORPUS_CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "import torch\nx = torch.randn(4, 8)\ny = x @ x.T\n",
    "class Block:\n    def __init__(self, size: int) -> None:\n        self.size = size\n",
    "if (x > 0) { return x; } else { return -x; }",
    "{\"name\": \"nano-vllm\", \"version\": \"0.1.0\", \"tags\": [\"llm\", \"inference\"]}",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "    \t\tindented\tline with tabs and  double  spaces\r\n",
    "First paragraph.\n\nSecond paragraph.\n\nThird one.\n",
    "<think>\nLet me think step by step.\n</think>\n\nThe answer is 4.",
]

_CORPUS_INTL = [
    "Café, crème brûlée, naïve façade, jalapeño, über, smörgåsbord.",
    "¿Dónde está la estación? Ça va très bien, merci beaucoup!",
    "Ærøskøbing, Łódź, Kraków, Brno, Škoda, Dvořák, São Paulo.",
    "你好，世界！今天天气很好。我们一起学习机器学习。",
    "こんにちは、世界。東京は日本の首都です。",
    "안녕하세요, 반갑습니다. 서울은 한국의 수도입니다.",
    "Привет, мир! Как дела? Всё хорошо.",
    "Emoji: 😀 😂 🚀 ❤️ 👍🏽 🎉 🇫🇷 👨‍👩‍👧",
    "Math: ∑ x² ≤ ∞, α β γ δ, π ≈ 3.14, ½ ¾ €100 £5 ¥10",
]


def _corpus() -> list[str]:
    base = _CORPUS_EN + _CORPUS_CODE + _CORPUS_INTL
    # Repeat with a few fixed variations so common pairs reach min_frequency.
    out: list[str] = []
    for rep in range(3):
        for s in base:
            out.append(s if rep == 0 else (s.lower() if rep == 1 else s.upper()))
    return out


def _build_backend_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != _BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens, expected {_BPE_VOCAB_SIZE}")
    for t in SPECIAL_TOKENS:
        tok.add_tokens(
            [AddedToken(t, special=t in _TRULY_SPECIAL, normalized=False, single_word=False, lstrip=False, rstrip=False)]
        )
    ids = special_token_ids()
    for t, i in ids.items():
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def _make_tokenizer_object():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_build_backend_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def make_tokenizer(path):
    """Build the tiny byte-level BPE tokenizer, save it into ``path`` and return it.

    Files written: tokenizer.json, tokenizer_config.json (with ``chat_template``),
    special_tokens_map.json.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _make_tokenizer_object()
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json (as Qwen3 ships it)
    # instead of writing a separate chat_template.jinja.
    tokenizer.save_pretrained(str(path), save_jinja_files=False)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    if cfg.get("chat_template") != CHAT_TEMPLATE:
        cfg["chat_template"] = CHAT_TEMPLATE
    cfg.pop("name_or_path", None)
    # 5.x writes "TokenizersBackend"; the alias PreTrainedTokenizerFast loads the same class in 5.x and
    # is also understood by older readers.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    stale = path / "chat_template.jinja"
    if stale.exists():
        stale.unlink()
    # transformers 5.x no longer writes special_tokens_map.json; keep it for older readers.
    (path / "special_tokens_map.json").write_text(
        json.dumps(
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
             "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]},
            indent=2,
            sort_keys=True,
        )
        + "\n",
        encoding="utf-8",
    )
    return tokenizer


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# Init scales (std of normal init).  Large enough that logits are far from ties, and that greedy
# decoding does not collapse into a single repeated token.
_EMBED_STD = 1.0
_LINEAR_STD = 0.2
_LM_HEAD_STD = 0.25
# Biases large enough that a dropped (or doubled) one moves logits far past the tests' tolerances.
_BIAS_STD = 0.2


def _default_vocab_size() -> int:
    n = TOKENIZER_VOCAB_SIZE
    return n if n % 2 == 1 else n + 1


@torch.no_grad()
def _init_weights(model, seed: int, tie: bool) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        shape = p.shape
        if name.endswith("norm.weight"):
            # RMSNorm weights around 1 but not all ones, so a forgotten norm weight is caught.
            w = 1.0 + 0.25 * (2.0 * torch.rand(shape, generator=gen) - 1.0)
        elif "embed_tokens" in name:
            w = torch.randn(shape, generator=gen) * _EMBED_STD
        elif name.startswith("lm_head"):
            w = torch.randn(shape, generator=gen) * _LM_HEAD_STD
        elif p.dim() >= 2:  # linear layers, the MoE router, stacked experts
            w = torch.randn(shape, generator=gen) * _LINEAR_STD
        else:  # biases (Qwen2 q/k/v, Llama with attention_bias / mlp_bias; Qwen3 has none)
            w = torch.randn(shape, generator=gen) * _BIAS_STD
        p.copy_(w.to(p.dtype))
    if tie:
        # Tied: logits = h @ E^T with E ~ N(0, 1) would be too peaked; rescale the shared matrix.
        model.get_input_embeddings().weight.mul_(0.5)


# Per family: transformers config class, model class, the options a family accepts beyond the
# common ones (name -> default).
_FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": False, "mlp_bias": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                   "decoder_sparse_step": 1, "mlp_only_layers": []}),
}
FAMILIES = tuple(_FAMILIES)


def make_tiny_model(
    path,
    family: str = "qwen3",
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = 16,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
    **family_options,
) -> str:
    """Create a random tiny checkpoint of `family` (see FAMILIES) in ``path``; return ``str(path)``.

    Files: config.json, generation_config.json, model.safetensors and, with ``with_tokenizer``,
    tokenizer.json, tokenizer_config.json, special_tokens_map.json. `head_dim=None` leaves it to
    hidden_size / num_heads (Qwen2 configs never name it). `rope_scaling`: e.g. Llama 3.1's
    ``{"rope_type": "llama3", "factor": ..., "low_freq_factor": ..., "high_freq_factor": ...,
    "original_max_position_embeddings": ...}``. `family_options`: llama ``attention_bias``,
    ``mlp_bias``; qwen3_moe ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``. MoE experts are saved as the
    Hub stores them, one tensor per expert and projection.
    """
    import transformers
    from transformers import GenerationConfig

    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    config_name, model_name, extra_defaults = _FAMILIES[family]
    unknown = set(family_options) - set(extra_defaults)
    if unknown:
        raise ValueError(f"options {sorted(unknown)} do not apply to {family}")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    if vocab_size is None:
        vocab_size = _default_vocab_size()
    if with_tokenizer and vocab_size < TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {TOKENIZER_VOCAB_SIZE}")
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = special_token_ids()
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    if vocab_size <= max(eot, im_end):  # (a tiny vocabulary without a tokenizer: its last id is EOS)
        eot = im_end = vocab_size - 1
    rope = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": float(rope_theta)}
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        initializer_range=0.02,
        **{**extra_defaults, **family_options},
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if family in ("qwen3", "qwen3_moe"):
        kwargs.update(attention_bias=False, use_sliding_window=False, max_window_layers=num_layers)
    if family == "qwen2":
        kwargs.update(use_sliding_window=False, max_window_layers=num_layers)
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    _init_weights(model, seed, tie_word_embeddings)
    model = model.to(dtype).eval()
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=eot,
        eos_token_id=[im_end, eot],
        pad_token_id=eot,
        do_sample=False,
    )
    model.save_pretrained(str(path), safe_serialization=True)
    _patch_config_json(path, model_name, dtype, rope_theta, rope_scaling, tie_word_embeddings)
    if family == "qwen3_moe":
        unfuse_expert_tensors(path)
    if with_tokenizer:
        make_tokenizer(path)
    return str(path)


def make_tiny_qwen3(path, **kwargs) -> str:
    """A random tiny Qwen3 checkpoint (see make_tiny_model)."""
    return make_tiny_model(path, "qwen3", **kwargs)


def make_tiny_qwen3_moe(path, **kwargs) -> str:
    """A random tiny Qwen3-MoE checkpoint, experts in the Hub's per-expert form (see make_tiny_model)."""
    return make_tiny_model(path, "qwen3_moe", **kwargs)


def _patch_config_json(path: Path, architecture: str, dtype, rope_theta, rope_scaling, tie: bool) -> None:
    """Make config.json look like a real checkpoint's for any reader (4.x or 5.x style)."""
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    cfg["architectures"] = [architecture]
    cfg["dtype"] = _DTYPE_NAMES[dtype]
    cfg["torch_dtype"] = _DTYPE_NAMES[dtype]  # pre-5.0 name
    cfg["rope_theta"] = float(rope_theta)  # pre-5.0 location; 5.x reads rope_parameters
    cfg["rope_scaling"] = dict(rope_scaling) if rope_scaling else None
    cfg["tie_word_embeddings"] = bool(tie)
    if "num_local_experts" in cfg:  # transformers 5.x writes its internal name; the Hub's is num_experts
        cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg.pop("_name_or_path", None)
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# transformers' fused expert tensors (<p>.experts.gate_up_proj [E, 2I, H], .down_proj [E, H, I])
# against the Hub's per-expert ones (<p>.experts.<e>.{gate,up,down}_proj.weight).
_FUSED_EXPERTS = re.compile(r"^(.+\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")


def rewrite_tensors(path, fn) -> None:
    """Replace a checkpoint folder's tensors with `fn(dict name -> tensor)` (edited in place, or
    the dict it returns)."""
    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    tensors = load_file(str(file))
    new = fn(tensors)
    tensors = tensors if new is None else new
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(file), metadata={"format": "pt"})


def unfuse_expert_tensors(path) -> None:
    """Rewrite a checkpoint's fused expert tensors in the Hub's per-expert form (no-op without any)."""

    def fn(tensors):
        out = {}
        for name, t in tensors.items():
            m = _FUSED_EXPERTS.match(name)
            if not m:
                out[name] = t
                continue
            for e in range(t.shape[0]):
                if m[2] == "down_proj":
                    out[f"{m[1]}.{e}.down_proj.weight"] = t[e]
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{m[1]}.{e}.gate_proj.weight"] = gate
                    out[f"{m[1]}.{e}.up_proj.weight"] = up
        return out

    rewrite_tensors(path, fn)


def fuse_expert_tensors(path) -> None:
    """Rewrite a checkpoint's per-expert tensors as transformers' fused 3-D ones (for loader
    tests); FP8 ones' `weight_scale_inv` become `gate_up_proj_scale_inv` / `down_proj_scale_inv`."""

    def fn(tensors):
        out, experts = {}, {}
        for name, t in tensors.items():
            m = _PER_EXPERT.match(name)
            if m:
                experts.setdefault((m[1], m[4]), {}).setdefault(int(m[2]), {})[m[3]] = t
            else:
                out[name] = t
        for (prefix, kind), by_expert in experts.items():
            suffix = "" if kind == "weight" else "_scale_inv"
            order = sorted(by_expert)
            out[f"{prefix}.gate_up_proj{suffix}"] = torch.stack(
                [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in order])
            out[f"{prefix}.down_proj{suffix}"] = torch.stack([by_expert[e]["down_proj"] for e in order])
        return out

    rewrite_tensors(path, fn)


# --------------------------------------------------------------------------------------------
# Reference helpers
# --------------------------------------------------------------------------------------------


def load_hf_model(path, dtype: torch.dtype = torch.float32, device="cpu"):
    """Load a checkpoint with transformers (eager attention), eval mode, on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")
    if hasattr(model, "set_experts_implementation") and getattr(model.config, "num_experts", 0):
        # The plain loop over experts, not the grouped-GEMM default of recent transformers 5.x:
        # the clearest reference (and the same arithmetic as ours). Older versions only have it.
        model.set_experts_implementation("eager")
    return model.to(device).eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy-decode exactly ``max_new_tokens`` tokens (EOS does not stop) and return only them."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    attention_mask = torch.ones_like(input_ids)
    pad = model.config.pad_token_id
    if pad is None:
        pad = 0
    gen_cfg = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=None,
        eos_token_id=None,
        pad_token_id=pad,
        bos_token_id=None,
        use_cache=True,
    )
    # transformers 5.x fills "unset" fields of a passed generation config from
    # model.generation_config (including eos_token_id), so blank EOS there too while generating.
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=gen_cfg,
        )
    finally:
        model.generation_config = saved
    gen = out[0, input_ids.shape[1]:].tolist()
    if len(gen) != max_new_tokens:
        raise RuntimeError(f"generate produced {len(gen)} tokens, expected {max_new_tokens}")
    return gen


# --------------------------------------------------------------------------------------------
# Named configurations for parametrised tests
# --------------------------------------------------------------------------------------------

CONFIGS: dict[str, dict] = {
    # grouped-query attention: 4 query heads share 2 kv heads
    "gqa": dict(num_heads=4, num_kv_heads=2, head_dim=16),
    # multi-query attention
    "mqa": dict(num_heads=4, num_kv_heads=1, head_dim=16),
    # lm_head shares the embedding matrix (no lm_head.weight in the checkpoint)
    "tied": dict(tie_word_embeddings=True),
    # odd vocab larger than the tokenizer (rows past the tokenizer are never produced by it)
    "odd_vocab": dict(vocab_size=TOKENIZER_VOCAB_SIZE + 90 if TOKENIZER_VOCAB_SIZE % 2 else TOKENIZER_VOCAB_SIZE + 91),
    # num_heads * head_dim != hidden_size (as in real Qwen3 models), 3 layers
    "wide_heads": dict(num_heads=4, num_kv_heads=2, head_dim=32, num_layers=3),
}


# Llama 3.1-style rope scaling scaled down to the tiny model: with head_dim 16 and theta 1e4 the
# wavelengths (6 ... 2e4 positions) fall on both sides of and between 64 / 4 and 64 / 1, so all
# three branches of the llama3 rule are used.
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}

# Named checkpoints of the other families, for parametrised tests (family + make_tiny_model options).
MODEL_CONFIGS: dict[str, dict] = {
    # q/k/v biases, GQA, embeddings tied as in Qwen2.5-0.5B ... 3B
    "qwen2_gqa_tied": dict(family="qwen2", num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    # q/k/v biases, multi-query attention, untied
    "qwen2_mqa": dict(family="qwen2", num_heads=4, num_kv_heads=1),
    # every bias Llama allows, llama3 rope scaling, GQA, untied
    "llama_bias_rope3": dict(family="llama", attention_bias=True, mlp_bias=True, rope_scaling=LLAMA3_ROPE_SCALING),
    # MQA, tied (Llama 3.2 1B/3B), head_dim named and num_heads * head_dim != hidden_size, 3 layers
    "llama_mqa_tied": dict(family="llama", num_kv_heads=1, head_dim=32, num_layers=3, tie_word_embeddings=True),
    # 8 experts top-2, renormalised; layer 1 dense (mlp_only_layers), layers 0 and 2 MoE
    "moe_norm_topk": dict(family="qwen3_moe", num_layers=3, norm_topk_prob=True, mlp_only_layers=[1]),
    # not renormalised, decoder_sparse_step 2 (layer 1 MoE; 0 and 2 dense), MQA, top-3
    "moe_sparse_step": dict(family="qwen3_moe", num_layers=3, num_kv_heads=1, norm_topk_prob=False,
                            decoder_sparse_step=2, num_experts_per_tok=3),
}


def make_named(path, name: str, **overrides) -> str:
    """A checkpoint of ``CONFIGS[name]`` (Qwen3) or ``MODEL_CONFIGS[name]`` (+ overrides) in ``path``."""
    if name in CONFIGS:
        return make_tiny_qwen3(path, **{**CONFIGS[name], **overrides})
    kwargs = {**MODEL_CONFIGS[name], **overrides}
    family = kwargs.pop("family")
    if family == "qwen2":
        kwargs.setdefault("head_dim", None)
    return make_tiny_model(path, family, **kwargs)


_CACHE_ROOT: str | None = None
_CACHE: dict[tuple, str] = {}


def tiny_qwen3_path(name: str = "gqa", **overrides) -> str:
    """Path of a checkpoint for ``CONFIGS[name]`` (plus ``overrides``), built once per process.

    The folders live in one temporary directory removed at interpreter exit.  Treat them as read-only.
    """
    global _CACHE_ROOT
    kwargs = {**CONFIGS[name], **overrides}
    key = (name, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
    if key not in _CACHE:
        if _CACHE_ROOT is None:
            _CACHE_ROOT = tempfile.mkdtemp(prefix="nanovllm-tiny-")
            atexit.register(shutil.rmtree, _CACHE_ROOT, True)
        folder = Path(_CACHE_ROOT) / f"{name}-{len(_CACHE)}"
        _CACHE[key] = make_tiny_qwen3(folder, **kwargs)
    return _CACHE[key]
