"""One request as the engine sees it: tokens, KV blocks and progress."""

from __future__ import annotations

from enum import Enum, auto

from nanovllm.sampling_params import SamplingParams


# Stands in for a sampled token that is still on the device (overlap scheduling: the next step
# is scheduled and launched before the previous one's tokens reach the host).
PENDING_TOKEN = -1


class SequenceStatus(Enum):
    WAITING = auto()   # no KV blocks; in the scheduler's waiting queue
    RUNNING = auto()   # owns KV blocks; prefilling or decoding
    FINISHED = auto()


class Sequence:
    """A prompt plus the tokens generated for it so far.

    `num_cached_tokens` counts the leading tokens whose K/V are already in the cache (prefix
    hits plus everything computed so far). A running sequence still prefilling has more than
    one uncomputed token; a decoding one has exactly one (the last sampled token).
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int):
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.seed = seed  # the request's own seed, or one drawn from the engine's RNG
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of the leading full blocks (prefix cache)
        self.num_committed_blocks = 0      # leading blocks already offered to the prefix cache
        self.num_preemptions = 0
        # Row of the in-flight step whose sampled token is this sequence's last token, which is
        # PENDING_TOKEN until the engine resolves that step; -1 when every token is known.
        self.pending_row = -1

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
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]
