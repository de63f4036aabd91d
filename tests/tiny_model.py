"""Tiny, locally generated Qwen3 checkpoints and tokenizer for tests.

Nothing here touches the network: the tokenizer is a byte-level BPE trained in memory on a small
built-in corpus, and the model is a randomly initialised ``transformers`` ``Qwen3ForCausalLM``
saved as safetensors.  Everything is deterministic: the same arguments give the same files.

Public API
----------
- ``make_tokenizer(path) -> PreTrainedTokenizerFast``
- ``make_tiny_qwen3(path, *, vocab_size=None, hidden_size=64, ...) -> str``
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
    "make_tiny_qwen3",
    "make_tokenizer",
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
        elif p.dim() == 2:
            w = torch.randn(shape, generator=gen) * _LINEAR_STD
        else:  # biases (Qwen3 has none) or anything else
            w = torch.randn(shape, generator=gen) * 0.02
        p.copy_(w.to(p.dtype))
    if tie:
        # Tied: logits = h @ E^T with E ~ N(0, 1) would be too peaked; rescale the shared matrix.
        model.get_input_embeddings().weight.mul_(0.5)


def make_tiny_qwen3(
    path,
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
) -> str:
    """Create a random tiny Qwen3 checkpoint (safetensors) in ``path`` and return ``str(path)``.

    Files: config.json, generation_config.json, model.safetensors and, with ``with_tokenizer``,
    tokenizer.json, tokenizer_config.json, special_tokens_map.json.
    """
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    if vocab_size is None:
        vocab_size = _default_vocab_size()
    if vocab_size < TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {TOKENIZER_VOCAB_SIZE}")
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = special_token_ids()
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=False,
        use_sliding_window=False,
        max_window_layers=num_layers,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        initializer_range=0.02,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
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
    _patch_config_json(path, dtype, rope_theta, tie_word_embeddings)
    if with_tokenizer:
        make_tokenizer(path)
    return str(path)


def _patch_config_json(path: Path, dtype, rope_theta, tie: bool) -> None:
    """Make config.json look like a real Qwen3 checkpoint for any reader (4.x or 5.x style)."""
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["dtype"] = _DTYPE_NAMES[dtype]
    cfg["torch_dtype"] = _DTYPE_NAMES[dtype]  # pre-5.0 name
    cfg["rope_theta"] = float(rope_theta)  # pre-5.0 location; 5.x reads rope_parameters
    cfg["rope_scaling"] = None
    cfg["tie_word_embeddings"] = bool(tie)
    cfg.pop("_name_or_path", None)
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Reference helpers
# --------------------------------------------------------------------------------------------


def load_hf_model(path, dtype: torch.dtype = torch.float32, device="cpu"):
    """Load a checkpoint with transformers (eager attention), eval mode, on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")
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
