"""`LLM(speculative_config={...})`, in vLLM's keys, checked before any weight loads."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nanovllm.features.speculative.eagle3_head import Eagle3Config, default_aux_layers
from nanovllm.features.speculative.layer_inputs import LayerInputs
from nanovllm.limits import clip_repr
from nanovllm.model.checkpoint import load_hf_config, resolve_model_path
from nanovllm.model.registry import model_class
from nanovllm.values import is_integer, is_real

METHODS = ("ngram", "draft_model", "eagle3")
# vLLM methods that nano-vllm does not run (yet): named in the error.
NOT_IMPLEMENTED = ("eagle", "medusa", "mlp_speculator", "deepseek_mtp", "mtp")
KEYS = frozenset({"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                  "draft_tensor_parallel_size", "disable_by_batch_size", "rejection_sample_method",
                  "synthetic_acceptance_rate", "synthetic_acceptance_rates", "synthetic_acceptance_length"})
SYNTHETIC_KEYS = ("synthetic_acceptance_rate", "synthetic_acceptance_rates", "synthetic_acceptance_length")
# Decode rows above which no step drafts: a drafting row gives up overlap with the host (it waits
# for its newest token) and verification multiplies its rows, which pays only while steps are
# bound by reading the weights.
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
# At most this many tokens (rows x (1 + drafts)) in a drafting step: fewer drafts per row as the
# batch grows, so a verification step stays about as cheap as a decode step.
DRAFT_TOKEN_BUDGET = 64


def _positive(options: dict, key: str, default=None) -> int | None:
    value = options.get(key, default)
    if value is None:
        return None
    if not is_integer(value) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config[{key!r}]={clip_repr(value)}: must be an integer >= 1")
    return int(value)


@dataclass(frozen=True)
class SpeculativeOptions:
    """The checked options: method, num_speculative_tokens (k, the most drafts per row and
    step), the n-gram sizes prompt lookup matches (longest first), disable_by_batch_size, and
    the draft's folder and config: "draft_model"'s transformers config, "eagle3"'s Eagle3Config."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int
    model: str | None = None
    draft_config: object = None
    # rejection_sample_method="synthetic" (benchmarks on random weights, which accept nothing):
    # the probability that draft j is kept given drafts 0..j-1 were, per position; None: lossless.
    synthetic_rates: tuple[float, ...] | None = None

    @classmethod
    def from_dict(cls, options, target_config=None, tensor_parallel_size: int = 1) -> "SpeculativeOptions":
        """Checked `options`; `target_config` (the target's transformers config) for a draft
        model's vocabulary (reads the draft's config.json, never its weights)."""
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config={clip_repr(options)}: must be a dict of vLLM's keys")
        unknown = sorted(set(options) - KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(sorted(KEYS))}")
        method = _method(options)
        k = _positive(options, "num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (an integer >= 1)")
        low, high = _positive(options, "prompt_lookup_min"), _positive(options, "prompt_lookup_max")
        low, high = low or high or 5, high or low or 5  # vLLM's: one given sets both; default 5
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min={low} is above prompt_lookup_max={high}")
        if _positive(options, "draft_tensor_parallel_size", 1) != 1:
            raise ValueError("speculative_config['draft_tensor_parallel_size']: only 1 is supported (the draft "
                             "runs on the first GPU)" if method == "draft_model" else
                             "speculative_config['draft_tensor_parallel_size'] applies to a draft model; the "
                             "'ngram' method has none")
        disable = _positive(options, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        model, draft = _draft(options, method, target_config)
        if draft is not None and tensor_parallel_size != 1:
            raise NotImplementedError(f"speculative_config: method {method!r} with tensor_parallel_size > 1 is not "
                                      f"supported yet (the 'ngram' method is)")
        return cls(method, k, low, high, disable, model, draft, synthetic_rates(options, k))

    def drafts_per_row(self, num_rows: int, max_rows: int) -> int:
        """How many tokens each of `num_rows` decode rows may draft this step: k at small batch,
        fewer as rows x (1 + drafts) reaches DRAFT_TOKEN_BUDGET or `max_rows` (the sampling rows a
        step may have), none past disable_by_batch_size."""
        if num_rows > self.disable_by_batch_size:
            return 0
        budget = min(DRAFT_TOKEN_BUDGET, max_rows)
        return max(0, min(self.num_speculative_tokens, budget // max(num_rows, 1) - 1))

    def kv_bytes_per_block(self, block_size: int, dtype) -> int:
        """What the draft's K/V take per block of the engine's cache (0 without a draft)."""
        o = self._draft_options()
        return 0 if o is None else 2 * o.num_layers * block_size * o.num_kv_heads * o.head_dim * dtype.itemsize

    def weight_bytes(self, dtype) -> int:
        """About what the draft's weights take (0 without one): embeddings (an EAGLE-3 head reads
        the target's), LM head unless tied, and per layer the attention and MLP projections (an
        EAGLE-3 head's attention reads 2 x hidden, and its fc 3 x the target's hidden)."""
        o = self._draft_options()
        if o is None:
            return 0
        h, q, kv = o.hidden_size, o.num_heads * o.head_dim, o.num_kv_heads * o.head_dim
        if self.method == "eagle3":
            head = self.draft_config
            return (2 * h * (q + 2 * kv) + q * h + 3 * h * o.intermediate_size + 3 * head.target_hidden_size * h
                    + head.draft_vocab_size * h) * dtype.itemsize
        layer = h * (q + 2 * kv) + q * h + 3 * h * o.intermediate_size
        return (o.vocab_size * h * (1 if o.tie_word_embeddings else 2) + o.num_layers * layer) * dtype.itemsize

    def prepare_model(self, model, max_tokens: int) -> None:
        """An EAGLE-3 head reads the inputs of three target layers: the model keeps them."""
        if self.method == "eagle3":
            model.layer_inputs = LayerInputs(model.model, self.draft_config.aux_layers, max_tokens)

    def _draft_options(self):
        """The draft's DecoderOptions (an EAGLE-3 head's one layer), or None without a draft."""
        if self.draft_config is None:
            return None
        if self.method == "eagle3":
            return self.draft_config.layer
        return model_class(self.draft_config).options_from_config(self.draft_config)


def _method(options: dict) -> str:
    method = options.get("method")
    if method is None and options.get("model") in ("ngram", "[ngram]"):
        method = "ngram"  # vLLM's older spelling
    elif method is None and options.get("model") is not None:
        method = "draft_model"  # a checkpoint without a method: a draft model
    if method in NOT_IMPLEMENTED:
        raise NotImplementedError(f"speculative_config['method']={method!r} is not supported by nano-vllm yet; "
                                  f"supported: {', '.join(METHODS)}")
    if method not in METHODS:
        raise ValueError(f"speculative_config['method']={clip_repr(method)}: must be one of {', '.join(METHODS)}")
    return method


def _draft(options: dict, method: str, target_config) -> tuple[str | None, object]:
    """(the draft's folder, its config) for "draft_model" and "eagle3", checked against the target."""
    if method == "ngram":
        return None, None
    model = options.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f"speculative_config: method {method!r} needs 'model', the draft checkpoint's folder")
    path = resolve_model_path(model, what="speculative_config['model']")
    if method == "eagle3":
        return path, _eagle3_head(path, target_config)
    draft = load_hf_config(path)
    if target_config is not None and draft.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config['model']: the draft's vocabulary ({draft.vocab_size} tokens) is not "
                         f"the target's ({target_config.vocab_size}): drafted ids would mean other tokens")
    return path, draft


def _eagle3_head(path: str, target_config) -> Eagle3Config:
    """An EAGLE-3 head's config (config.json only), checked against the target's."""
    try:
        head = Eagle3Config.from_folder(path)
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"speculative_config['model']={path!r}: not an EAGLE-3 head's config.json "
                         f"({type(e).__name__}: {e})") from e
    if target_config is None:
        return head
    checks = (("vocabulary", head.layer.vocab_size, target_config.vocab_size),
              ("target hidden size", head.target_hidden_size, target_config.hidden_size))
    for what, got, want in checks:
        if got != want:
            raise ValueError(f"speculative_config['model']: the EAGLE-3 head's {what} ({got}) is not the "
                             f"target's ({want})")
    num = target_config.num_hidden_layers
    layers = head.aux_layers or default_aux_layers(num)
    if len(layers) != 3 or not all(0 <= i < num for i in layers):
        raise ValueError(f"speculative_config['model']: the EAGLE-3 head would read the inputs of target layers "
                         f"{list(layers)}; the target has {num} (3 of 0..{num - 1} expected)")
    return replace(head, aux_layers=tuple(layers))


def synthetic_rates(options: dict, k: int) -> tuple[float, ...] | None:
    """The conditional keep probability per draft position for rejection_sample_method
    "synthetic", from exactly one of: `synthetic_acceptance_rate` (the same at every position),
    vLLM's `synthetic_acceptance_rates` (unconditional: the chance that the first j + 1 drafts
    are all kept, non-increasing) or `synthetic_acceptance_length` (mean tokens per verification,
    in [1, k + 1]: as many drafts always kept as it allows, the next one by the remainder)."""
    method = options.get("rejection_sample_method", "standard")
    given = [key for key in SYNTHETIC_KEYS if options.get(key) is not None]
    if method not in ("standard", "synthetic"):
        raise ValueError(f"speculative_config['rejection_sample_method']={clip_repr(method)}: must be "
                         f"'standard' or 'synthetic'")
    if method == "standard":
        if given:
            raise ValueError(f"speculative_config[{given[0]!r}] needs rejection_sample_method='synthetic'")
        return None
    if len(given) != 1:
        raise ValueError("rejection_sample_method='synthetic' needs exactly one of " + ", ".join(SYNTHETIC_KEYS))
    value = options[given[0]]
    if given[0] == "synthetic_acceptance_rate":
        if not is_real(value) or not 0.0 <= value <= 1.0:
            raise ValueError(f"speculative_config['synthetic_acceptance_rate']={clip_repr(value)}: must be in [0, 1]")
        return (float(value),) * k
    if given[0] == "synthetic_acceptance_length":
        if not is_real(value) or not 1.0 <= value <= k + 1:
            raise ValueError(f"speculative_config['synthetic_acceptance_length']={clip_repr(value)}: must be in "
                             f"[1, {k + 1}]")
        full = int(value - 1)
        value = ([1.0] * full + [value - 1 - full] + [0.0] * k)[:k]
    if not isinstance(value, (list, tuple)) or len(value) != k or not all(is_real(r) and 0 <= r <= 1 for r in value) \
            or any(b > a for a, b in zip(value, value[1:])):
        raise ValueError(f"speculative_config['synthetic_acceptance_rates']={clip_repr(value)}: must be {k} "
                         f"non-increasing numbers in [0, 1]")
    return tuple(0.0 if prev == 0 else min(1.0, r / prev) for prev, r in zip((1.0, *value[:-1]), value))
