"""Request preparation: a request's prompt and SamplingParams turned into what the engine adds.

Preparing is tokenizing (or rendering the chat template and tokenizing), checking the token ids,
the engine's copy of the SamplingParams (bad words tokenized, logit_bias and logprob limits) and
that the request fits the context and the KV cache. It is the same code as offline `generate`
runs (`LLM`'s own methods). The server runs it in preparer workers (preparer_pool.py) on a
`RequestPreparer`, so that the engine's process only steps; an in-process EngineLoop runs it on
its LLM.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import nanovllm.wiring as wiring
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.engine import LLMEngine, load_tokenizer
from nanovllm.llm import LLM
from nanovllm.logprob_outputs import token_texts
from nanovllm.sampling_params import SamplingParams


@dataclass
class ChatPrompt:
    """A conversation to render through the chat template (as `LLM.chat` does)."""

    messages: list
    template_kwargs: dict = field(default_factory=dict)


@dataclass
class Prepared:
    """A prepared request: its prompt's token ids, the engine's validated copy of its
    SamplingParams (None when it is only tokenized), the prompt's text if it has one (or was
    asked for), and the text of its first token (asked for by echo with logprobs)."""

    prompt_token_ids: list[int]
    params: SamplingParams | None
    prompt_text: str | None
    first_token_text: str | None = None


@dataclass(frozen=True)
class PrepareConfig:
    """The Config fields that preparing a request reads (the tokenizer's, and the limits that
    prepare_params / check_fits check), under Config's names."""

    model: str
    tokenizer: str | None
    tokenizer_mode: str
    trust_remote_code: bool
    revision: str | None
    skip_tokenizer_init: bool
    max_model_len: int
    max_logprobs: int
    max_num_seqs: int

    @classmethod
    def of(cls, config) -> "PrepareConfig":
        return cls(*(getattr(config, f.name) for f in dataclasses.fields(cls)))


@dataclass(frozen=True)
class PreparerSpec:
    """What preparing needs of an engine (picklable, for the workers): those Config fields, the
    vocabulary size and the KV cache's size."""

    config: PrepareConfig
    vocab_size: int
    num_blocks: int
    block_size: int

    @classmethod
    def of(cls, llm: LLM) -> "PreparerSpec":
        bm = llm.block_manager
        return cls(PrepareConfig.of(llm.config), llm.vocab_size, bm.num_blocks, bm.block_size)


@dataclass(frozen=True)
class KVSize:
    """The size of an engine's KV cache (what check_fits reads of a block manager)."""

    num_blocks: int
    block_size: int
    blocks_for = BlockManager.blocks_for


class RequestPreparer:
    """An engine's request checks without the engine: LLM's own methods (the code offline
    generate runs) on the attributes they read, made from a PreparerSpec; the tokenizer is
    loaded as the engine loads it."""

    tokenize = LLMEngine.tokenize
    check_fits = LLMEngine.check_fits
    room_after = LLMEngine.room_after
    prepare_for_prompt = LLMEngine.prepare_for_prompt
    _prompt = LLM._prompt
    chat_prompt_ids = LLM.chat_prompt_ids

    def __init__(self, spec: PreparerSpec):
        c = self.config = spec.config
        self.vocab_size = spec.vocab_size
        self.block_manager = KVSize(spec.num_blocks, spec.block_size)
        self.tokenizer = None if c.skip_tokenizer_init else \
            load_tokenizer(c.tokenizer or c.model, c.tokenizer_mode, c.trust_remote_code, c.revision)
        self._token_texts: dict[int, str] = {}

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """LLMEngine's checks, and bad words tokenized as LLM's override does (without its
        structured outputs: the engine prepares those itself, see is_small)."""
        p = LLMEngine.prepare_params(self, params)
        wiring.tokenize_bad_words(self, p)
        return p


def prepare_one(front, r) -> Prepared:
    """Prepare request `r` (an EngineRequest, or anything with its fields: prompt, params,
    fill_max_tokens, want_prompt_text, tokenize_only) on `front` (an LLM or a RequestPreparer)."""
    if isinstance(r.prompt, ChatPrompt):
        ids, text = front.chat_prompt_ids(r.prompt.messages, **r.prompt.template_kwargs), None
    else:
        ids, text = front._prompt(r.prompt)
    if r.want_prompt_text and text is None and front.tokenizer is not None:
        text = front.tokenizer.decode(ids)
    if r.tokenize_only:
        if r.want_prompt_text and text is None:
            raise ValueError("turning token ids into text needs a tokenizer (the engine was started "
                             "with skip_tokenizer_init)")
        return Prepared(ids, None, text)
    params = r.params
    if r.fill_max_tokens:
        params = copy.copy(params)  # (the caller's object may serve several prompts)
        params.max_tokens = max(1, front.room_after(len(ids)))
    params = front.prepare_for_prompt(params, len(ids))
    front.check_fits(len(ids), params)
    first = token_texts(front, ids[:1])[0] if r.want_prompt_text and ids and front.tokenizer is not None else None
    return Prepared(ids, params, text, first)


def prepare_requests(front, requests: list) -> list[Prepared]:
    """Every request prepared (one already prepared, with a `prepared` set, is kept), or the
    first error, naming its prompt when there are several: ValueError / TypeError /
    NotImplementedError. Anything else raised while preparing (a chat template's
    raise_exception, a tokenizer error) is the request's fault: a ValueError naming it."""
    out = []
    for i, r in enumerate(requests):
        done = getattr(r, "prepared", None)
        if done is not None:
            out.append(done)
            continue
        where = f"prompt {i}: " if len(requests) > 1 else ""
        try:
            out.append(prepare_one(front, r))
        except (ValueError, TypeError, NotImplementedError) as e:
            raise type(e)(f"{where}{e}") from None
        except Exception as e:  # noqa: BLE001 (the request's fault, e.g. jinja2's TemplateError)
            raise ValueError(f"{where}{type(e).__name__}: {e}") from None
    return out


# What the engine prepares itself, on its own thread, as it did before the preparer workers: a
# request this small costs it ~0.1 ms (a few thousand characters or token ids, the model's own
# chat template, a handful of stops / bias entries / bad words), while a worker's round trip
# costs ~0.6 ms and two workers queue a burst of arrivals (64 at once: 20 ms median, measured on
# the CPU box), which is what raised the server's time to first token on the H200. Anything
# larger goes to the workers, so that one huge request never holds up the other streams.
SMALL_PROMPT = 8192  # characters of text, or token ids
SMALL_LISTS = 16  # stop strings, bad words, logit_bias entries
SMALL_TOKEN_IDS = 1024  # allowed_token_ids and stop_token_ids together


def is_small(r) -> bool:
    """Whether request `r` (an EngineRequest) is cheap enough for the engine to prepare itself."""
    prompt, p = r.prompt, r.params
    if p is not None and p.structured_outputs is not None:
        return True  # its grammar is compiled (and checked) by the engine's compiler, cached there
    if isinstance(prompt, ChatPrompt):
        if prompt.template_kwargs:  # (a request's own template, or options for the model's)
            return False
        contents = [m.get("content") if isinstance(m, dict) else None for m in prompt.messages]
        size = sum(len(c) if isinstance(c, str) else SMALL_PROMPT + 1 for c in contents)
    elif isinstance(prompt, (str, list, tuple)):
        size = len(prompt)
    else:
        return False  # (a prompt dict, or anything else: the workers check it)
    if size > SMALL_PROMPT or p is None:
        return size <= SMALL_PROMPT
    stops = [p.stop] if isinstance(p.stop, str) else list(p.stop or ())
    return (all(len(x) <= SMALL_LISTS for x in (stops, p.bad_words or (), p.logit_bias or {}))
            and sum(map(len, stops)) <= SMALL_PROMPT
            and len(p.allowed_token_ids or ()) + len(p.stop_token_ids or ()) <= SMALL_TOKEN_IDS)
