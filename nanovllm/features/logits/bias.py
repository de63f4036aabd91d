"""allowed_token_ids, bad words and logit_bias. Plugs into core/hooks.py's LogitsExtension.

vLLM's order: allowed_token_ids, bad words, then logit_bias, on the raw fp32 logits (the
penalties follow). A bad word of one token is banned outright; one of several tokens has its
last token banned where the output ends with the rest, checked every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.core.engine import encode_text
from nanovllm.core.sequence import Sequence
from nanovllm.limits import clip_repr, describe_ids
from nanovllm.model.attention import host_to_device
from nanovllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def bad_word_ids(tokenizer, words: tuple[str, ...], vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token ids, alone and after a space (vLLM's rule: the spaced form
    counts when it is as many tokens and starts with another token)."""
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer (skip_tokenizer_init=True was given)")
    out = []
    for word in words:
        plain = encode_text(tokenizer, word.lstrip(), "SamplingParams.bad_words", add_special_tokens=False)
        if not plain:
            raise ValueError(f"SamplingParams.bad_words: {clip_repr(word)} gives no tokens")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(tuple(plain))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(tuple(spaced))
    bad = sorted({t for w in out for t in w if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"SamplingParams.bad_words: token ids {describe_ids(bad)} are outside the vocabulary")
    return tuple(out)


def mask_to_allowed(x: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """In place: x[rows[i], j] = -inf wherever allowed [len(rows), V] bool is False."""
    x[rows] = x[rows].masked_fill_(~allowed, _NEG_INF)


def ban(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, active: torch.Tensor | None = None) -> None:
    """In place: x[rows[i], cols[i]] = -inf (only where active[i], a bool tensor, if given).
    Repeated (row, col) pairs are fine: -inf is added, and -inf + anything finite is -inf."""
    add = x.new_full(rows.shape, _NEG_INF)
    if active is not None:
        add = torch.where(active, add, 0.0)
    x.index_put_((rows, cols), add, accumulate=True)


def add_bias(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, bias: torch.Tensor) -> None:
    """In place: x[rows[i], cols[i]] += bias[i] (logit_bias)."""
    x.index_put_((rows, cols), bias, accumulate=True)


@dataclass
class BiasRows:
    """A batch's device tensors: allowed (rows, mask [a, V]), bans (rows, cols), bias (rows,
    cols, values), each None when no row has it; `dynamic`: (row, sequence, multi-token bad
    words) whose ban depends on the latest tokens."""

    allowed: tuple[torch.Tensor, torch.Tensor] | None
    bans: tuple[torch.Tensor, torch.Tensor] | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    dynamic: list[tuple[int, Sequence, list[tuple[int, ...]]]]


class TokenBias:
    """LogitsExtension: allowed_token_ids, bad words and logit_bias, before the penalties.
    prev_tokens: the sampler's device buffer of the last step's tokens (see ban_word_ends)."""

    order = 10

    def __init__(self, device: torch.device, pin: bool, prev_tokens: torch.Tensor):
        self.device, self.pin, self.prev_tokens = device, pin, prev_tokens

    def applies(self, params: SamplingParams) -> bool:
        return bool(params.bias) or params.allowed_ids is not None or bool(params.bad_word_ids)

    def _dev(self, data, dtype=torch.long) -> torch.Tensor:
        return host_to_device(data, dtype, self.device, self.pin)

    def build(self, rows: list[Sequence], where: list[int], vocab_size: int) -> BiasRows:
        allowed_rows, allowed_cols, allowed_of = [], [], []
        ban_rows, ban_cols, bias_rows, bias_cols, bias_vals, dynamic = [], [], [], [], [], []
        for i in where:
            s, p = rows[i], rows[i].params
            if p.allowed_ids is not None:
                allowed_of.append(i)
                allowed_cols.extend(p.allowed_ids)
                allowed_rows.extend([len(allowed_of) - 1] * len(p.allowed_ids))
            multi = []
            for word in p.bad_word_ids:
                if len(word) == 1:
                    ban_rows.append(i)
                    ban_cols.append(word[0])
                else:
                    multi.append(word)
            if multi:
                dynamic.append((i, s, multi))
            if p.bias:
                bias_rows.extend([i] * len(p.bias))
                bias_cols.extend(p.bias.keys())
                bias_vals.extend(p.bias.values())
        allowed = None
        if allowed_of:
            mask = torch.zeros(len(allowed_of), vocab_size, dtype=torch.bool, device=self.device)
            mask[self._dev(allowed_rows), self._dev(allowed_cols)] = True
            allowed = (self._dev(allowed_of), mask)
        bans = (self._dev(ban_rows), self._dev(ban_cols)) if ban_rows else None
        bias = None
        if bias_rows:
            bias = (self._dev(bias_rows), self._dev(bias_cols), self._dev(bias_vals, torch.float32))
        return BiasRows(allowed, bans, bias, dynamic)

    def prepare(self, state, step=None) -> bool:
        return False  # (all its work is on the device)

    def transform(self, logits: torch.Tensor, state: BiasRows, step=None) -> None:
        if state.allowed is not None:
            mask_to_allowed(logits, *state.allowed)
        if state.bans is not None:
            ban(logits, *state.bans)
        if state.dynamic:
            self.ban_word_ends(logits, state.dynamic)
        if state.bias is not None:
            add_bias(logits, *state.bias)

    def ban_word_ends(self, x: torch.Tensor, dynamic) -> None:
        """Bad words of several tokens: ban a word's last token where the output ends with the
        rest. The host knows every output token but, with overlap scheduling, maybe not the
        newest one, still on the device (row `pending_row` of the previous step's tokens): that
        comparison is made on the device."""
        rows, cols, src, want = [], [], [], []
        for i, s, words in dynamic:
            out = s.completion_token_ids
            pending = s.pending_row
            for word in words:
                m = len(word) - 1  # tokens that must end the output
                if len(out) < m:
                    continue
                if pending >= 0:
                    if out[len(out) - m:-1] != list(word[:m - 1]):
                        continue
                    src.append(pending)
                    want.append(word[m - 1])
                else:
                    if out[len(out) - m:] != list(word[:m]):
                        continue
                    src.append(-1)
                    want.append(-1)
                rows.append(i)
                cols.append(word[m])
        if not rows:
            return
        src_t, want_t = self._dev(src), self._dev(want)
        last = self.prev_tokens.index_select(0, src_t.clamp(min=0)).long()
        ban(x, self._dev(rows), self._dev(cols), (src_t < 0) | (last == want_t))

    def observe(self, state: BiasRows, tokens: torch.Tensor) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass
