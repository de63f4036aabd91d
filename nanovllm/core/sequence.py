"""One request as the engine sees it: tokens, KV blocks and progress."""

from __future__ import annotations

from enum import Enum, auto

from nanovllm.sampling_params import SamplingParams

# A sampled token still on the device (overlap scheduling: the next step is launched first).
PENDING_TOKEN = -1


class SequenceStatus(Enum):
    WAITING = auto()   # no KV blocks; in the scheduler's waiting queue
    RUNNING = auto()   # owns KV blocks; prefilling or decoding
    DRAINING = auto()  # out of the queues, no KV blocks: its last token (and finish reason) on its way
    FINISHED = auto()
    FORK_PENDING = auto()  # sample i > 0 of an n > 1 request, forked from sample 0 once its prompt is computed


class Sequence:
    """A prompt plus the tokens generated for it so far. `num_cached_tokens` counts the leading
    tokens whose K/V are in the cache (prefix hits plus everything computed): a running sequence
    still prefilling has more than one uncomputed token, a decoding one exactly one."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 sample_index: int = 0):
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.seed = seed  # the request's own seed, or one drawn from the engine's RNG
        self.sample_index = sample_index  # which of the request's n completions this is
        self.request_id = str(seq_id)  # the engine sets its own (LLMEngine.add_request)
        self.prompt_text: str | None = None
        self.status = SequenceStatus.WAITING if sample_index == 0 else SequenceStatus.FORK_PENDING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of the leading full blocks (prefix cache)
        self.num_committed_blocks = 0      # leading blocks already offered to the prefix cache
        self.reads_prefix_cache = True     # False: compute every prompt token (prompt logprobs)
        self.adapter = 0  # the request's adapter (LoRA) id, 0: none; its blocks are cached under it
        self.adapter_slot = -1  # the model's slot holding that adapter while it runs (-1: none)
        self.num_cached_prompt_tokens: int | None = None  # prefix-cache hits when first scheduled
        self.num_preemptions = 0
        self.pending_row = -1  # row of the in-flight step sampling the last token (PENDING_TOKEN); -1: none
        # Tokens drafted after the pending one (speculative decoding), verified in the rows after pending_row.
        self.drafts: list[int] = []
        # The request's samples, itself first; those still to fork from it, and the blocks held for them.
        self.samples: list[Sequence] = [self]
        self.pending_forks: list[Sequence] = []
        self.reserved_blocks: list[int] = []
        # Per generated token (logprob, rank, top ids, top logprobs); the same per prompt token after
        # the first, and how many prompt positions launched steps compute them for.
        self.logprobs: list[tuple] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[tuple] | None = [] if params.prompt_logprobs is not None else None
        self.num_prompt_logprobs_planned = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={len(self)}, cached={self.num_cached_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.name})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        """No more steps run for it (its finish reason may still be on its way: DRAINING)."""
        return self.status in (SequenceStatus.DRAINING, SequenceStatus.FINISHED)

    def reached_length(self, max_model_len: int) -> bool:
        """Whether it may not grow any more: max_tokens generated, or max_model_len long."""
        return self.num_completion_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len

    @property
    def has_pending_token(self) -> bool:
        return self.pending_row >= 0

    def add_pending_token(self, row: int) -> None:
        """The step just launched samples this sequence's next token in `row`: hold its place."""
        if self.has_pending_token:
            raise RuntimeError(f"{self} already waits for a token")
        self.token_ids.append(PENDING_TOKEN)
        self.pending_row = row

    def fill_pending_token(self, token_id: int) -> None:
        self.token_ids[-1] = token_id
        self.pending_row = -1

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark the request ended, once: a finish reason is never overwritten."""
        if self.status == SequenceStatus.FINISHED:
            raise RuntimeError(f"{self} already finished ({self.finish_reason})")
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]
