"""The per-step token mask of structured outputs: a LogitsExtension (core/hooks.py) that keeps
every constrained row's next token inside its grammar; rows without a constraint pay nothing.

Each constrained sequence has an xgrammar matcher that has accepted its output so far. A step's
mask needs the row's newest token, which overlap scheduling may still hold on the device: the
sampler's last published host copy has it. A worker thread waits for that copy, advances the
matchers and fills the bitmask (32 tokens a word; xgrammar's batch calls run on several threads
without the GIL), while the device runs the forward pass and the engine's thread resolves the
last step and schedules the next (the sampler defers this step's draw until then: `prepare`
returns True); the mask then travels to the device and sets the forbidden logits to -inf before
the filters and the draw. This costs about 60 us of CPU per row in a JSON string (measured), so
done inline it would add milliseconds to each step of a large batch.

A finished output (the grammar complete) allows only the stop tokens, so the row ends on EOS.
Under speculative decoding each drafted position is masked as plain decoding would mask it
after the drafts before it (a fork of the matcher that took them): verification stays lossless.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from nanovllm.core.sequence import Sequence
from nanovllm.features.logits.processing import logits_processing
from nanovllm.features.structured.grammars import Grammars, xgr
from nanovllm.model.attention import host_to_device

logger = logging.getLogger(__name__)
SWITCH_INTERVAL_S = 0.0002


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t % 32 of bitmask[i, t // 32] is 0.
    logits fp32 [R, V]; bitmask int32 [len(rows), ceil(V / 32)] on logits' device. On CUDA
    xgrammar's Triton kernel (one pass over the masked rows; the torch ops below move ~1 GB a
    step for 256 rows of a 152k vocabulary), rows of no constraint given all-ones bits."""
    if logits.is_cuda:
        if rows.numel() != logits.shape[0]:
            full = bitmask.new_full((logits.shape[0], bitmask.shape[1]), -1)
            full[rows] = bitmask
            bitmask = full
        xgr.apply_token_bitmask_inplace(logits, bitmask, backend="triton")
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :logits.shape[1]]
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))


@dataclass
class _Matcher:
    matcher: object  # xgr.GrammarMatcher
    consumed: int = 0  # output tokens it has seen
    broken: bool = False  # a token it refused was sampled (logged once; the row runs unconstrained)
    end_id: int | None = None  # the reasoning's end token, while the reasoning lasts (unconstrained)


@dataclass
class MaskRows:
    """A batch's constrained rows: their sequences, batch row numbers (host and device) and a
    pinned host bitmask."""

    seqs: list[Sequence]
    where: list[int]
    rows: torch.Tensor
    host: torch.Tensor
    filled: Future | None = None  # the worker's fill of `host` for this step


class StructuredOutputs:
    """LogitsExtension: the grammar mask, first of the extensions (before allowed ids, bias and
    penalties, as vLLM applies it). `last_published()`: the sampler's last step's PendingTokens."""

    order = 0

    def __init__(self, grammars: Grammars, device: torch.device, pin: bool, last_published):
        self.grammars, self.device, self.pin, self.last_published = grammars, device, pin, last_published
        self.batch = xgr.BatchGrammarMatcher()  # (its calls release the GIL and use several threads)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanovllm-grammar")
        # The worker takes the GIL back after each wait and xgrammar call (three times a step)
        # while the engine's thread runs Python; CPython hands it over only after the switch
        # interval (5 ms by default), longer than a decode step. 0.2 ms: the H200 profile's
        # constrained step went from 10.8 to 7.3 ms (BENCHMARKS.md). Process-wide, like all of it.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.matchers: dict[int, _Matcher] = {}
        self._host: torch.Tensor | None = None  # the bitmask's host buffer (see build)
        if device.type == "cuda":
            self._compile_mask_kernel(grammars.info.vocab_size)

    def _compile_mask_kernel(self, vocab: int) -> None:
        """xgrammar's Triton mask kernel specializes its row count (1, a multiple of 16, any
        other): compile all three now, as the first constrained request arrives, rather than in
        the middle of later steps (a second or more each, cold)."""
        for n in (1, 16, 17):
            bits = torch.full((n, (vocab + 31) // 32), -1, dtype=torch.int32, device=self.device)
            apply_bitmask(torch.zeros(n, vocab, device=self.device), torch.arange(n, device=self.device), bits)

    @classmethod
    def check(cls, engine, spec) -> None:
        """Compile `spec` (ValueError naming what is wrong) with the extension on `engine`'s
        (rank 0's) sampler, registered at the first use; a data-parallel front has no sampler:
        it compiles to check, and each replica registers its own as the request reaches it."""
        sampler = getattr(engine.model_runner, "sampler", None)
        processing = None if sampler is None else logits_processing(sampler)
        ext = None if processing is None else next((e for e in processing.extensions if isinstance(e, cls)), None)
        if ext is None:
            grammars = engine.__dict__.get("_grammars") or Grammars(engine.tokenizer, engine.vocab_size,
                                                                    engine.eos_token_ids)
            if sampler is None:
                engine.__dict__["_grammars"] = grammars
                grammars.compile(spec)
                return
            ext = cls(grammars, sampler.device, sampler.pin, sampler.last_published)
            processing.add_extension(ext)
        ext.grammars.compile(spec)

    def applies(self, params) -> bool:
        return params.structured_outputs is not None

    def build(self, rows: list[Sequence], where: list[int], vocab_size: int) -> MaskRows:
        # One pinned buffer for every batch (pinning one per batch change cost ~2.7 ms): the
        # worker fills it only after the last step's tokens are on the host, and every copy
        # out of it was queued before those.
        words = (vocab_size + 31) // 32
        if self._host is None or self._host.shape[0] < len(where) or self._host.shape[1] != words:
            host = torch.empty(max(len(where), 64), words, dtype=torch.int32)
            self._host = host.pin_memory() if self.pin else host
        host = self._host[:len(where)]
        return MaskRows([rows[i] for i in where], where, host_to_device(where, torch.long, self.device, self.pin),
                        host)

    def _matcher(self, seq: Sequence) -> _Matcher:
        m = self.matchers.get(seq.seq_id)
        if m is None:
            so = seq.params.structured_outputs
            m = self.matchers[seq.seq_id] = _Matcher(xgr.GrammarMatcher(self.grammars.compile(so)))
            if so._reasoning_end is not None:
                end = self.grammars.token_id(so._reasoning_end)
                # Thinking switched off: the template closed the reasoning at the prompt's end.
                m.end_id = None if end is None or end in seq.prompt_token_ids[-4:] else end
        return m

    def prepare(self, state: MaskRows, step=None) -> bool:
        """Note on this thread what each matcher has not seen yet (the sequences change once the
        engine goes on), then advance the matchers and fill the bitmask on the worker thread."""
        plan, prev = [], None
        for j, seq in enumerate(state.seqs):
            if seq is prev:  # a row verifying the draft before it
                plan.append((None, step.token_ids[state.where[j]][0], None, seq.seq_id))
                continue
            prev, m = seq, self._matcher(seq)
            done = seq.num_completion_tokens  # (not completion_token_ids: a copy of the whole output)
            new = seq.token_ids[seq.num_prompt_tokens + m.consumed:] if m.consumed < done else []
            m.consumed = done
            plan.append((m, new, seq.pending_row if new and seq.has_pending_token else None, seq.seq_id))
        state.filled = self.worker.submit(self._fill, state, plan, self.last_published())
        return True

    @torch.inference_mode()  # (per thread: the bitmask was made under the sampler's)
    def _fill(self, state: MaskRows, plan: list, last) -> None:
        # The last step's copy of this bitmask has left once its tokens have (queued after it;
        # before the first published step no copy was made): one wait, as each return to
        # Python from a wait costs a GIL handover.
        tokens = last.result() if last is not None else None
        self._feed([p for p in plan if p[0] is not None], tokens)
        matchers, indices = [], []
        m = current = reasoning = None
        for j, (entry, new_or_draft, _, _) in enumerate(plan):
            if entry is not None:
                m, reasoning = entry, entry.end_id
                current = None if m.broken or reasoning is not None or m.matcher.is_terminated() else m.matcher
            else:
                current, reasoning = self._after_draft(m, current, reasoning, new_or_draft)
            if current is None:
                state.host[j].fill_(-1)  # every token allowed (a free row, or one whose sample goes unused)
            else:
                matchers.append(current)
                indices.append(j)
        if matchers:
            self.batch.batch_fill_next_token_bitmask(matchers, state.host, indices)

    def _feed(self, plan: list, tokens: list[int] | None) -> None:
        """Each matcher takes its sequence's new output tokens (the newest from `tokens`, the
        last published step's, when it was on its way); one token each in one batched call."""
        one_m, one_t, one_id = [], [], []
        for m, new, pending, seq_id in plan:
            if pending is not None:
                new[-1] = tokens[pending]
            if not new or m.broken or m.matcher.is_terminated():
                continue  # (terminated: EOS taken; with ignore_eos the rest is free)
            if m.end_id is not None:  # still reasoning: the grammar starts after its end token
                if m.end_id not in new:
                    continue
                new, m.end_id = new[new.index(m.end_id) + 1:], None
            if len(new) == 1:
                one_m.append(m)
                one_t.append(new[0])
                one_id.append(seq_id)
            elif not all(m.matcher.accept_token(t) for t in new):
                self._broken(m, seq_id)
        accepted = self.batch.batch_accept_token([m.matcher for m in one_m], one_t) if one_m else []
        for m, ok, seq_id in zip(one_m, accepted, one_id):
            if not ok:
                self._broken(m, seq_id)

    @staticmethod
    def _broken(m: _Matcher, seq_id: int) -> None:
        m.broken = True
        logger.warning("request %s: a sampled token does not fit its structured_outputs grammar; its output is no "
                       "longer constrained", seq_id)

    def transform(self, logits: torch.Tensor, state: MaskRows, step=None) -> None:
        """The rows' masks (filled by the worker: a row that verifies a draft, under speculative
        decoding, from a fork of the matcher that took the drafts before it) onto the logits."""
        state.filled.result()
        apply_bitmask(logits, state.rows, state.host.to(self.device, non_blocking=self.pin))

    @staticmethod
    def _after_draft(m: _Matcher, current, reasoning: int | None, draft: int):
        """(the matcher state, the reasoning's end token while it lasts) of the row after `draft`."""
        if reasoning is not None:  # the grammar starts after a drafted end of the reasoning
            return (m.matcher.fork(), None) if draft == reasoning and not m.broken else (None, reasoning)
        if current is None:
            return None, None
        current = current.fork()
        if not current.accept_token(draft) or current.is_terminated():
            current = None  # the draft breaks (or ends) the grammar: the row before rejects it
        return current, None

    def observe(self, state: MaskRows, tokens: torch.Tensor) -> None:
        pass  # the matchers read the tokens from the host at the next step

    def release(self, seq: Sequence) -> None:
        self.matchers.pop(seq.seq_id, None)
