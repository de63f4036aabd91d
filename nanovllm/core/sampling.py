"""Each step's next tokens: sampled on the device, kept there for the next step, and sent to the
host in the background (overlap scheduling).

`TokenSampler` (one per rank) owns the device buffer of the last step's sampled tokens, from
which the next step takes the input token of every sequence whose last token the host has not
seen yet, and the pinned host copies the tokens travel through (`PendingTokens`). With tensor
parallelism it also decides who samples (`samples_on_every_rank`, the one place): every rank
from its vocabulary shard (`RowSampling`) or rank 0 from gathered logits.

Requests that change their logits (penalties, logit_bias, allowed_token_ids, bad_words) or ask
for logprobs take extra device work on their rows only (`LogitsProcessing`, layers/
logits_processors.py); a step in which no row asks for any of it runs exactly the plain path.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from nanovllm.core.sequence import Sequence
from nanovllm.features import logits_processors as lp
from nanovllm.core.sampler import Sampler, SamplingTensors, filters_off, pick_candidates
from nanovllm.model.attention import host_to_device


def suppressed_tokens(seq: Sequence, eos_token_ids: frozenset[int]) -> set[int]:
    """Tokens `seq` may not sample yet (before min_tokens): its stop ids and, unless it
    ignores EOS, the EOS tokens."""
    if seq.num_completion_tokens >= seq.params.min_tokens:
        return set()
    return set(seq.params.stop_ids) | (set() if seq.params.ignore_eos else set(eos_token_ids))


def needs_gathered_logits(seq: Sequence, eos_token_ids: frozenset[int]) -> bool:
    """Whether a row must be sampled from the whole vocabulary's logits (rank 0 with tensor
    parallelism): top-k, top-p or min-p, tokens suppressed by min_tokens, penalties, logit_bias,
    allowed_token_ids, bad_words or logprobs. Otherwise the best of per-shard candidates is its
    token (Sampler.candidates)."""
    p = seq.params
    return (not filters_off(p) or p.processes_logits or p.logprobs is not None
            or bool(suppressed_tokens(seq, eos_token_ids)))


def samples_on_every_rank(rows: list[Sequence], eos_token_ids: frozenset[int], prompt_logprobs: bool) -> bool:
    """THE tensor-parallel sampling decision of a step: every rank samples its vocabulary shard
    only when no row needs gathered logits and no prompt logprobs are computed (they need the
    whole vocabulary too); else rank 0 gathers the logits and samples alone."""
    return not prompt_logprobs and not any(needs_gathered_logits(s, eos_token_ids) for s in rows)


@dataclass
class RowSampling:
    """What every tensor-parallel rank needs to sample its vocabulary shard, for rows whose
    filters are off (sampler.filters_off) and that suppress nothing: per-row temperature, seed
    and offset, as rank 0's TokenSampler.sample would use them."""

    temperatures: list[float]
    seeds: list[int]
    offsets: list[int]

    @classmethod
    def from_seqs(cls, seqs: list[Sequence]) -> "RowSampling":
        return cls([float(s.params.temperature) for s in seqs], [s.seed for s in seqs], [len(s) for s in seqs])

    @classmethod
    def for_every_rank(cls, rows: list[Sequence], eos_token_ids: frozenset[int],
                       prompt_logprobs: bool = False) -> "RowSampling | None":
        """Sampling on every rank for these rows, or None when rank 0 must sample the gathered
        logits (see samples_on_every_rank)."""
        if samples_on_every_rank(rows, eos_token_ids, prompt_logprobs):
            return cls.from_seqs(rows)
        return None


@dataclass
class StepLogprobs:
    """A step's logprob entries on the host, as the lifecycle stores them: `sample[row]` for the
    sampling rows that asked, `prompt` as (batch row, entries of its next prompt positions).
    An entry is (logprob, rank, top ids, top logprobs) of one token (Sequence.logprobs)."""

    sample: dict[int, tuple]
    prompt: list[tuple[int, list[tuple]]]


def _entries(vals: list[list[float]], ids: list[list[int]], k: int) -> list[tuple]:
    return [(v[0], i[0], i[1:k + 1], v[1:k + 1]) for v, i in zip(vals, ids)]


class _LogprobCopies:
    """Logprob tensors of one step on their way to the host (pinned, non-blocking), and what the
    host needs to split them: sample rows and their k; prompt owners (row, positions, k)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.sample = None  # (rows, ks, vals, ids)
        self.prompt = None  # (owners, vals, ids)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        host.copy_(t, non_blocking=self.pin)
        return host

    def add_sample(self, rows: list[int], ks: list[int], vals, ids) -> None:
        self.sample = (rows, ks, self._to_host(vals), self._to_host(ids))

    def add_prompt(self, owners: list[tuple[int, int, int]], vals, ids) -> None:
        self.prompt = (owners, self._to_host(vals), self._to_host(ids))

    def result(self) -> StepLogprobs:
        sample, prompt = {}, []
        if self.sample is not None:
            rows, ks, vals, ids = self.sample
            for row, k, v, i in zip(rows, ks, vals.tolist(), ids.tolist()):
                sample[row] = _entries([v], [i], k)[0]
        if self.prompt is not None:
            owners, vals, ids = self.prompt
            vals, ids, at = vals.tolist(), ids.tolist(), 0
            for row, count, k in owners:
                prompt.append((row, _entries(vals[at:at + count], ids[at:at + count], k)))
                at += count
        return StepLogprobs(sample, prompt)


class PendingTokens:
    """Sampled tokens on their way to the host; `result()` waits for them (and only for them).

    check: with tensor parallelism, raises once a peer died; then the wait polls the event and
    calls it meanwhile and after, since a dead peer's collectives may never finish, or finish
    (aborted) with garbage in the tokens. `logprobs()`: the step's StepLogprobs (after result()),
    or None when no row asked."""

    def __init__(self, host: torch.Tensor, n: int, event, check=None, logprobs: _LogprobCopies | None = None):
        self._host, self._n, self._event, self._check = host, n, event, check
        self._logprobs = logprobs

    def result(self) -> list[int]:
        if self._event is not None:
            if self._check is None:
                self._event.synchronize()
            else:
                while not self._event.query():
                    self._check()
                    time.sleep(0)  # lets the watchdog thread run
        if self._check is not None:
            self._check()
        return self._host[:self._n].tolist()

    def logprobs(self) -> StepLogprobs | None:
        return None if self._logprobs is None else self._logprobs.result()


@dataclass
class LogitsProcessing:
    """A batch's per-row extras on the device, built when its rows change (TokenSampler._tensors):
    the rows of each kind of logits processing and their parameters, and the rows that want
    logprobs. `dynamic_bans`: (row, sequence, multi-token bad words) whose ban depends on the
    latest tokens, checked every step."""

    allowed: tuple[torch.Tensor, torch.Tensor] | None = None            # rows, mask [a, V]
    bans: tuple[torch.Tensor, torch.Tensor] | None = None               # rows, cols
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, cols, values
    penalty_rows: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    dynamic_bans: list | None = None
    logprob_rows: list[int] | None = None
    logprob_ks: list[int] | None = None
    logprob_rows_t: torch.Tensor | None = None

    @property
    def changes_logits(self) -> bool:
        return (self.allowed is not None or self.bans is not None or self.bias is not None
                or self.penalty_rows is not None or bool(self.dynamic_bans))


class TokenSampler:
    """Samples the next token of each row on one rank and hands the tokens to the host."""

    def __init__(self, max_rows: int, device: torch.device, tp):
        self.device, self.tp = device, tp
        self.pin = device.type == "cuda"
        self.sampler = Sampler()
        # The last step's sampled tokens, one row per scheduled sequence, kept on the device for
        # the next step's inputs; two pinned host copies alternate so that reading step n's
        # tokens never races with step n+1 writing its own.
        self.prev_tokens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self._host = [torch.zeros(max_rows, dtype=torch.int32, pin_memory=self.pin) for _ in range(2)]
        self._events = [torch.cuda.Event() if self.pin else None for _ in range(2)]
        self._flip = 0
        self._cache = None  # (key, SamplingTensors, LogitsProcessing | None) of the last step, see _tensors
        self.counts: lp.TokenCounts | None = None  # penalty state, made on first use

    def input_tokens(self, ids: torch.Tensor, src_rows: torch.Tensor) -> torch.Tensor:
        """Input token per row: the host's, or (src >= 0) the previous step's sampled token that
        is still on the device. Part of the captured decode graph, so it costs no launches."""
        return torch.where(src_rows >= 0, self.prev_tokens.index_select(0, src_rows.clamp(min=0)), ids)

    def share_previous(self) -> None:
        """Only rank 0 sampled the previous step: hand its tokens to every rank, on the device."""
        self.tp.broadcast_from_rank0(self.prev_tokens)

    def release(self, seq: Sequence) -> None:
        """`seq` ended: free its penalty state."""
        if self.counts is not None:
            self.counts.release(seq.seq_id)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[Sequence], eos_token_ids: frozenset[int],
               check=None, step=None) -> PendingTokens:
        """The next token of each row (rank 0) from logits [len(rows) (+ prompt-logprob rows), V],
        left in `prev_tokens` for the next step and copied to the host without blocking. `step`
        (StepInput) says which trailing logits rows are prompt positions for prompt logprobs."""
        n = len(rows)
        prompt_logits = None
        if step is not None and step.prompt_rows:
            logits, prompt_logits = logits[:n], logits[n:]
        offsets = [len(s) for s in rows]
        t, proc = self._tensors([s.seq_id for s in rows], offsets,
                               lambda: self._build(rows, offsets, logits.shape[-1]))
        rws, cols = [], []
        for i, s in enumerate(rows):
            banned = suppressed_tokens(s, eos_token_ids)
            rws.extend([i] * len(banned))
            cols.extend(banned)
        suppress = None
        if rws:
            suppress = (host_to_device(rws, torch.long, self.device, self.pin),
                        host_to_device(cols, torch.long, self.device, self.pin))
        x = logits
        if proc is not None and proc.changes_logits:
            x = self._process(logits, rows, proc)
        tokens = self.sampler(x, t, suppress)
        copies = None
        if proc is not None and proc.logprob_rows:
            copies = _LogprobCopies(self.pin)
            r = proc.logprob_rows_t
            k = max(proc.logprob_ks)
            vals, ids = lp.gather_logprobs(logits.index_select(0, r), tokens.index_select(0, r), k)
            copies.add_sample(proc.logprob_rows, proc.logprob_ks, vals, ids)
        if prompt_logits is not None:
            copies = copies or _LogprobCopies(self.pin)
            targets = host_to_device(step.prompt_targets, torch.long, self.device, self.pin)
            vocab = prompt_logits.shape[-1]
            owners = [(row, count, vocab if want < 0 else min(want, vocab)) for row, count, want in step.prompt_owners]
            vals, ids = lp.gather_logprobs(prompt_logits, targets, max(k for _, _, k in owners))
            copies.add_prompt(owners, vals, ids)
        if proc is not None and proc.penalty_rows is not None:
            self.counts.add(proc.slots, tokens.index_select(0, proc.penalty_rows))
        self.prev_tokens[:n].copy_(tokens)
        return self.publish(n, check, copies)

    def _build(self, rows: list[Sequence], offsets: list[int], vocab: int):
        t = SamplingTensors.build([s.params for s in rows], [s.seed for s in rows], offsets, self.device,
                                  pin_memory=self.pin)
        proc = None
        if any(s.params.processes_logits or s.params.logprobs is not None for s in rows):
            proc = self._build_processing(rows, vocab)
        return t, proc

    def _build_processing(self, rows: list[Sequence], vocab: int) -> LogitsProcessing:
        """The device tensors of a batch's logits processing and logprobs (rows that ask only)."""
        dev = lambda data, dtype: host_to_device(data, dtype, self.device, self.pin)  # noqa: E731
        proc = LogitsProcessing()
        allowed_rows, allowed_cols, allowed_of = [], [], []
        ban_rows, ban_cols, bias_rows, bias_cols, bias_vals = [], [], [], [], []
        pen_rows, pen_seqs, dynamic, lp_rows, lp_ks = [], [], [], [], []
        for i, s in enumerate(rows):
            p = s.params
            if p.logprobs is not None:
                lp_rows.append(i)
                lp_ks.append(p.logprobs)
            if not p.processes_logits:
                continue
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
            if p.uses_penalties:
                pen_rows.append(i)
                pen_seqs.append(s)
        if allowed_of:
            mask = torch.zeros(len(allowed_of), vocab, dtype=torch.bool, device=self.device)
            mask[dev(allowed_rows, torch.long), dev(allowed_cols, torch.long)] = True
            proc.allowed = (dev(allowed_of, torch.long), mask)
        if ban_rows:
            proc.bans = (dev(ban_rows, torch.long), dev(ban_cols, torch.long))
        if bias_rows:
            proc.bias = (dev(bias_rows, torch.long), dev(bias_cols, torch.long), dev(bias_vals, torch.float32))
        if pen_rows:
            if self.counts is None:
                self.counts = lp.TokenCounts(vocab, self.device)
            slots = []
            for s in pen_seqs:
                slot = self.counts.slot(s.seq_id)
                if slot is None:  # first sampled here: every token of it is known to the host
                    slot = self.counts.assign(s.seq_id, s.prompt_token_ids, s.completion_token_ids)
                slots.append(slot)
            ps = [s.params for s in pen_seqs]
            proc.penalty_rows = dev(pen_rows, torch.long)
            proc.slots = dev(slots, torch.long)
            if any(p.repetition_penalty != 1.0 for p in ps):
                proc.repetition = dev([p.repetition_penalty for p in ps], torch.float32)
            if any(p.frequency_penalty != 0.0 for p in ps):
                proc.frequency = dev([p.frequency_penalty for p in ps], torch.float32)
            if any(p.presence_penalty != 0.0 for p in ps):
                proc.presence = dev([p.presence_penalty for p in ps], torch.float32)
        proc.dynamic_bans = dynamic or None
        if lp_rows:
            proc.logprob_rows, proc.logprob_rows_t = lp_rows, dev(lp_rows, torch.long)
            proc.logprob_ks = [vocab if k < 0 else min(k, vocab) for k in lp_ks]
        return proc

    def _process(self, logits: torch.Tensor, rows: list[Sequence], proc: LogitsProcessing) -> torch.Tensor:
        """A new fp32 tensor: the logits after allowed_token_ids, bad words, logit_bias and the
        penalties (vLLM's order)."""
        x = logits.to(torch.float32, copy=True)
        if proc.allowed is not None:
            lp.mask_to_allowed(x, *proc.allowed)
        if proc.bans is not None:
            lp.ban(x, *proc.bans)
        if proc.dynamic_bans:
            self._ban_bad_word_ends(x, proc.dynamic_bans)
        if proc.bias is not None:
            lp.add_bias(x, *proc.bias)
        if proc.penalty_rows is not None:
            c = self.counts
            in_prompt = c.in_prompt.index_select(0, proc.slots) if proc.repetition is not None else None
            lp.apply_penalties(x, proc.penalty_rows, c.counts.index_select(0, proc.slots), in_prompt,
                               proc.repetition, proc.frequency, proc.presence)
        return x

    def _ban_bad_word_ends(self, x: torch.Tensor, dynamic) -> None:
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
        dev = lambda data: host_to_device(data, torch.long, self.device, self.pin)  # noqa: E731
        src_t, want_t = dev(src), dev(want)
        last = self.prev_tokens.index_select(0, src_t.clamp(min=0)).long()
        lp.ban(x, dev(rows), dev(cols), (src_t < 0) | (last == want_t))

    @torch.inference_mode()
    def sample_shards(self, model, hidden: torch.Tensor, rows: RowSampling) -> torch.Tensor:
        """Tensor parallelism, rows without top-k/top-p/min-p or suppressed tokens: each rank
        offers its vocabulary shard's best candidate per row and every rank picks the same
        tokens from all candidates. Sends two numbers per row and rank instead of gathering
        [rows, vocab] logits on rank 0, and the next step needs no broadcast of the tokens."""
        key = ("rows", rows.temperatures, rows.seeds)  # never equal to sample()'s id list
        t, _ = self._tensors(key, rows.offsets, lambda: (SamplingTensors.temperature_only(
            rows.temperatures, rows.seeds, rows.offsets, self.device, self.pin), None))
        logits, first_id = model.compute_logit_shard(hidden)
        scores, ids = self.sampler.candidates(logits, t, first_id)
        # One collective for both: float64 holds the fp32 scores and the token ids exactly.
        every = self.tp.all_gather(torch.stack([scores.double(), ids.double()]))  # [ranks, 2, rows]
        tokens = pick_candidates(every[:, 0], every[:, 1].long())
        self.prev_tokens[:len(tokens)].copy_(tokens)
        return tokens

    def publish(self, n: int, check=None, logprobs: _LogprobCopies | None = None) -> PendingTokens:
        """Start copying the step's sampled tokens (`prev_tokens[:n]`) to the host (`check`:
        see PendingTokens); `logprobs`' copies were queued before, so the same event covers them."""
        self._flip ^= 1
        host, event = self._host[self._flip], self._events[self._flip]
        host[:n].copy_(self.prev_tokens[:n], non_blocking=self.pin)
        if event is not None:
            event.record()
        return PendingTokens(host, n, event, check, logprobs)

    def _tensors(self, key, offsets: list[int], build):
        """`build()` -> (SamplingTensors, LogitsProcessing | None), or the last step's with new
        offsets when `key` (what fixes the per-row parameters) is unchanged: consecutive decode
        steps usually sample the same rows with the same parameters, and then only the offsets
        (sequence lengths) change."""
        cached = self._cache
        if cached is not None and cached[0] == key:
            t = dataclasses.replace(cached[1], offsets=host_to_device(offsets, torch.long, self.device, self.pin))
            proc = cached[2]
        else:
            t, proc = build()
        self._cache = (key, t, proc)
        return t, proc
