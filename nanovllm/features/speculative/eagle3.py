"""The "eagle3" method's Proposer: an EAGLE-3 head (eagle3_head.py) drafts from the target's own
hidden states, one cheap layer per drafted token.

Two halves, on one rank (the target's; tensor parallelism is refused by options.py):
- After every target step (core/hooks.py's AfterSampling, still on the device): the head runs
  over all the step's tokens, each position t reading the target's hidden states at t (kept by
  layer_inputs.py) and the token at t + 1: the next prompt
  token, or the token the step just sampled at t. That writes the head's K/V for every position
  (its cache uses the engine's block tables, as the draft model's does) and leaves, per sampling
  row, the head's output and its first draft. A verifying row's rows past the first rejection
  are computed for nothing and overwritten by the next step.
- When the drafting hook asks (propose): the row kept for each sequence is the one at its
  second-newest position (its newest token is what that row read); its draft is the first, and
  k - 1 head decode steps, each feeding back the head's output, make the rest.
Past disable_by_batch_size the first half is skipped: the head's K/V of those positions stay
stale (drafting later reads them; still lossless, drafts are only worse), as in vLLM.
"""

from __future__ import annotations

import math
from weakref import WeakKeyDictionary

import numpy as np
import torch

from nanovllm.core.cuda_graphs import DecodeGraphs
from nanovllm.core.kv_cache import KVCacheSpec, allocate_kv_cache
from nanovllm.core.runner_extras import copy_blocks
from nanovllm.core.step_inputs import StepInput, StepInputs
from nanovllm.features.speculative.drafting import take_draft_slots
from nanovllm.features.speculative.eagle3_head import Eagle3Head, load_head
from nanovllm.model.attention import host_to_device
from nanovllm.model.dummy_weights import init_dummy
from nanovllm.parallel.group import TPGroup, use_tp_group


class Eagle3Proposer:
    """Drafts with the head of `options.model` for the engine whose ModelRunner is `runner`."""

    def __init__(self, options, runner):
        config = self.config = runner.config
        self.device, self.max_rows = runner.device, options.disable_by_batch_size
        self.head = _build_head(options, runner)
        attn = self.head.layers[0].self_attn.attn
        attn.backend = runner.backend
        spec = KVCacheSpec(1, config.kvcache_block_size, attn.num_kv_heads, attn.head_dim, config.kv_dtype)
        # Zeroed: a position the head never wrote (stale, see the module docstring) stays finite.
        self.kv_cache = allocate_kv_cache(spec, runner.num_blocks, [attn], self.device).zero_()
        max_blocks = math.ceil(config.max_model_len / config.kvcache_block_size)
        self.inputs = StepInputs(max(config.max_num_seqs, 1), max_blocks, config.kvcache_block_size, self.device,
                                 runner.backend.name, attn.num_kv_heads)
        # Sequence -> (head outputs [rows, H], first drafts [rows], position of row 0, preemptions)
        self._rows: WeakKeyDictionary = WeakKeyDictionary()
        self.graphs = None
        if runner.graphs is not None:  # (CUDA with graphs: the head's draft steps replay too)
            self._capture_graphs(min(config.max_num_seqs, self.max_rows))

    def _capture_graphs(self, max_bs: int) -> None:
        """Graphs of one head draft step (its forward and greedy draft) per batch size: eagerly a
        step launches ~25 small kernels, whose host time at batch 1 exceeds the GPU's. Inputs go
        through the fixed buffers below and the decode buffers of `inputs`."""
        h, dtype = self.head.config.layer.hidden_size, self.config.dtype
        self._tokens_in = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        self._hidden_in = torch.zeros(max_bs, h, dtype=dtype, device=self.device)
        self._drafts_out = torch.zeros(max_bs, dtype=torch.long, device=self.device)

        def step(ids, positions, meta):
            out = self.head(ids, positions, self._hidden_in[:len(ids)], meta)
            self._drafts_out[:len(ids)] = self.head.draft_tokens(out)
            return out
        self.graphs = DecodeGraphs(step, self.inputs, lambda ids, src: self._tokens_in[:len(ids)], max_bs, h, dtype)

    # ------------------------------------------------------------------ after each target step
    @torch.inference_mode()
    def after_sampling(self, runner, batch, step: StepInput) -> None:
        if len(batch.seqs) > self.max_rows or runner.forward_inputs is None:
            for seq in batch.seqs:
                self._rows.pop(seq, None)
            return
        positions, meta = runner.forward_inputs
        num = positions.numel()  # (a replayed graph's padded batch: its padding rows write nowhere)
        known, src, ends = _next_tokens(batch.rows, step, num)
        tokens = runner.sampler.input_tokens(self._index(known), self._index(src))
        aux = runner.model.layer_inputs.rows(num)
        out = self.head(tokens, positions, aux, meta).index_select(0, self._index(ends))
        drafts = self.head.draft_tokens(out)
        first = 0
        for seq, count in _entries(batch, step):
            position = step.start_pos[first] + len(step.token_ids[first]) - 1  # of the first row's token
            self._rows[seq] = (out[first:first + count], drafts[first:first + count], position,
                               seq.num_preemptions)
            first += count
        if step.block_copies:  # a prompt's last block copied for its forked samples: the head's too
            copy_blocks(self.kv_cache, step.block_copies, self.device)

    def _index(self, values) -> torch.Tensor:
        return host_to_device(values, torch.long, self.device, self.device.type == "cuda")

    # ------------------------------------------------------------------ drafting
    def _row(self, seq) -> tuple | None:
        """(head output [1, H], first draft [1]) of the row at `seq`'s second-newest position."""
        kept = self._rows.get(seq)
        if kept is None or kept[3] != seq.num_preemptions:
            return None
        out, drafts, start, _ = kept
        row = len(seq) - 2 - start
        return (out[row:row + 1], drafts[row:row + 1]) if 0 <= row < len(drafts) else None

    @torch.inference_mode()
    def propose(self, seqs: list, ks: list[int], block_manager) -> list[list[int]]:
        live, rows = [], []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            row = self._row(seq)
            if row is not None and take_draft_slots(block_manager, seq, k):
                live.append(i)
                rows.append(row)
        out = [[] for _ in seqs]
        if not live:
            return out
        hidden, token = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        going = list(range(len(live)))  # the rows (indices into live) still drafting, in order
        steps = [(going, token)]
        for j in range(1, max(ks[i] for i in live)):
            keep = [m for m, n in enumerate(going) if ks[live[n]] > j]
            if len(keep) < len(going):
                index = self._index(keep)
                hidden, token = hidden.index_select(0, index), token.index_select(0, index)
                going = [going[m] for m in keep]
            hidden, token = self._decode_step([seqs[live[n]] for n in going], j, token, hidden)
            steps.append((going, token))
        host = iter(torch.cat([t for _, t in steps]).tolist())  # (the one wait for the device)
        for going, _ in steps:
            for n in going:
                out[live[n]].append(next(host))
        return out

    def _decode_step(self, seqs: list, j: int, tokens: torch.Tensor, hidden: torch.Tensor):
        """Head step j for `seqs`: draft j at position len(seq) - 2 + j, after `hidden`; the
        head's outputs and the next drafts."""
        n = len(seqs)
        step = StepInput(False, [[0]] * n, [len(s) - 2 + j for s in seqs], [s.block_table for s in seqs])
        bs = self.graphs.batch_size_for(n) if self.graphs is not None else None
        if bs is None:
            _, positions, meta = self.inputs.decode(step, n, lambda ids, src: ids)
            out = self.head(tokens, positions, hidden, meta)
            return out, self.head.draft_tokens(out)
        self._tokens_in[:n].copy_(tokens)
        self._hidden_in[:n].copy_(hidden)
        out = self.graphs.replay(step, bs)
        return out.clone(), self._drafts_out[:n].clone()  # (the next replay overwrites both)

    def verified(self, seq, drafted: int, accepted: int) -> None:
        """Nothing to do: the step's own rows (after_sampling) say where the sequence is."""


def _entries(batch, step: StepInput):
    """(sequence, its consecutive entries in `step`): one entry per sampling row."""
    rows = batch.rows[:len(step.token_ids)]
    i = 0
    while i < len(rows):
        n = 1
        while i + n < len(rows) and rows[i + n] is rows[i]:
            n += 1
        yield rows[i], n
        i += n


def _next_tokens(rows: list, step: StepInput, num: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each of the step's `num` packed tokens (padding past the step's), the token after it:
    (known ids, 0 where unknown; source rows: the sampling row whose token it is, -1 where
    known; the packed index of each entry's last token). An entry's last token is followed by
    its sequence's next token if the host has it (a chunk with more to come), else by the token
    sampled there."""
    lens = np.fromiter(map(len, step.token_ids), dtype=np.int64, count=len(step.token_ids))
    ends = np.cumsum(lens) - 1
    flat = np.fromiter((t for ids in step.token_ids for t in ids), dtype=np.int64, count=int(lens.sum()))
    known = np.zeros(num, dtype=np.int64)
    known[:len(flat) - 1] = flat[1:]
    src = np.full(num, -1, dtype=np.int64)
    for i, (seq, start, n) in enumerate(zip(rows, step.start_pos, lens.tolist())):
        after = start + n
        if after < len(seq):  # a prompt chunk (or a recomputed sequence's) with more to come
            known[ends[i]] = seq.token_ids[after]
        else:
            known[ends[i]], src[ends[i]] = 0, i
    return known, src, ends


def _build_head(options, runner) -> Eagle3Head:
    """The head on the runner's device in its dtype: the checkpoint's weights (or random ones
    with load_format="dummy"), reading the target's embedding when the shapes fit."""
    config, head_config = runner.config, options.draft_config
    default = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(runner.device), use_tp_group(TPGroup()):
            head = Eagle3Head(head_config, max_positions=config.max_model_len)
    finally:
        torch.set_default_dtype(default)
    target = runner.model.model.embed_tokens.weight
    shared = target if tuple(target.shape) == tuple(head.embed_tokens.weight.shape) else None
    if config.load_format == "dummy":
        init_dummy(head, config.seed + 1)
        if shared is not None:
            head.embed_tokens.weight = shared
        head.layers[0].norm_before_residual = head_config.norm_before_residual
    else:
        load_head(head, options.model, target_embedding=shared)
    return head.eval()
