"""The "draft_model" method's Proposer (drafting.py): a smaller model with the same vocabulary
drafts k tokens greedily, one decode step each.

The draft keeps its K/V in the engine's own blocks (the same block tables, a cache tensor of its
own: the KV budget charges both, core/kv_cache.py), so it needs no bookkeeping of its own but
how many leading tokens of each request it has computed. Before drafting, it catches up on the
tokens it has not seen: a new request's whole prompt as a prefill (from position 0; prefix-cache
hits carry only the target's K/V), afterwards the few tokens the last verification kept, as one
decode row per position (drafting.py's verifying_step), so both run without the prefix path.
Greedy drafts make the draft's distribution one-hot, where keeping a draft while it equals the
target's sample (core/lifecycle.py) is exactly rejection sampling.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch

from nanovllm.config import Config
from nanovllm.core.model_runner import ModelRunner
from nanovllm.core.step_inputs import StepInput
from nanovllm.features.speculative.drafting import take_draft_slots


class DraftModelProposer:
    """Drafts from `options.model` for an engine of `config` whose cache has `num_blocks`."""

    def __init__(self, options, config, num_blocks: int):
        draft = Config.from_kwargs(
            options.model, device=config.device, dtype=config.dtype, max_model_len=config.max_model_len,
            kvcache_block_size=config.kvcache_block_size, num_kvcache_blocks=num_blocks,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enforce_eager=config.enforce_eager, load_format=config.load_format, seed=config.seed,
            skip_tokenizer_init=True, attention_backend=config.attention_backend).resolve()
        if draft.max_model_len < config.max_model_len:
            raise ValueError(f"speculative_config['model']: the draft reads at most {draft.max_model_len} positions, "
                             f"the engine's max_model_len is {config.max_model_len}")
        self.runner = ModelRunner(draft)
        self._computed: WeakKeyDictionary = WeakKeyDictionary()  # Sequence -> (preemptions, tokens with K/V)
        self._proposed: WeakKeyDictionary = WeakKeyDictionary()  # Sequence -> its length when drafted

    def _start(self, seq) -> int:
        """How many leading tokens of `seq` have the draft's K/V (0 after a preemption)."""
        preemptions, computed = self._computed.get(seq, (-1, 0))
        return computed if preemptions == seq.num_preemptions else 0

    @torch.inference_mode()
    def _next_tokens(self, steps: list[StepInput]) -> list[int]:
        """The draft's greedy token after each row of the steps, in order; a decode step of more
        rows than the runner's buffers hold (max_num_seqs) runs in parts."""
        out, rows = [], self.runner.config.max_num_seqs
        for step in steps:
            parts = [step] if step.is_prefill else [
                StepInput(False, step.token_ids[i:i + rows], step.start_pos[i:i + rows], step.block_tables[i:i + rows])
                for i in range(0, len(step.token_ids), rows)]
            for part in parts:
                if part.token_ids:
                    out.extend(self.runner.execute(part).argmax(dim=-1).tolist())
        return out

    def _catch_up(self, seqs: list) -> list[int]:
        """Run the draft over each sequence's tokens it has not computed; its next token for each."""
        fresh = [s for s in seqs if self._start(s) == 0]
        known = [s for s in seqs if self._start(s) > 0]
        groups, size = [[]], 0  # fresh prompts in steps of at most max_num_batched_tokens (or one prompt)
        for s in fresh:
            if groups[-1] and size + len(s) > self.runner.config.max_num_batched_tokens:
                groups.append([])
                size = 0
            groups[-1].append(s)
            size += len(s)
        prefills = [StepInput(True, [s.token_ids for s in g], [0] * len(g), [s.block_table for s in g]) for g in groups]
        tokens, starts, tables, last = [], [], [], []
        for s in known:
            for pos in range(self._start(s), len(s)):
                tokens.append([s.token_ids[pos]])
                starts.append(pos)
                tables.append(s.block_table)
            last.append(len(tokens) - 1)
        decode = StepInput(False, tokens, starts, tables)
        firsts = self._next_tokens(prefills)
        rows = self._next_tokens([decode])
        by_seq = dict(zip(map(id, fresh), firsts)) | {id(s): rows[i] for s, i in zip(known, last)}
        return [by_seq[id(s)] for s in seqs]

    def propose(self, seqs: list, ks: list[int], block_manager) -> list[list[int]]:
        live = []
        for i, (s, k) in enumerate(zip(seqs, ks)):
            if take_draft_slots(block_manager, s, k):  # the draft's K/V of its drafts go there too
                live.append(i)
        drafted = [seqs[i] for i in live]
        drafts = [[t] for t in self._catch_up(drafted)] if drafted else []
        for j in range(1, max((ks[i] for i in live), default=0)):
            rows = [n for n, i in enumerate(live) if ks[i] > j]
            step = StepInput(False, [[drafts[n][-1]] for n in rows], [len(drafted[n]) - 1 + j for n in rows],
                             [drafted[n].block_table for n in rows])
            for n, token in zip(rows, self._next_tokens([step])):
                drafts[n].append(token)
        for s in drafted:
            self._computed[s] = (s.num_preemptions, len(s))
            self._proposed[s] = (s.num_preemptions, len(s))
        out = [[] for _ in seqs]
        for n, i in enumerate(live):
            out[i] = drafts[n]
        return out

    def verified(self, seq, drafted: int, accepted: int) -> None:
        """The draft's K/V of the first min(accepted, drafted - 1) drafts are of kept tokens."""
        proposed = self._proposed.pop(seq, None)
        if proposed is not None:  # (under the preemption count of the proposal: a later one voids it)
            preemptions, length = proposed
            self._computed[seq] = (preemptions, length + min(accepted, drafted - 1))
