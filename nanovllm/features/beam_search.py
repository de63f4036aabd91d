"""Beam search (`LLM.beam_search`, vLLM's algorithm and output): each step extends every live beam
by one token through `generate` with `max_tokens=1` and `logprobs=2 * beam_width`, keeps the
`beam_width` best candidates of each prompt by cumulative logprob, and sets aside those that end
(EOS, unless ignore_eos). Beams of one prompt share their prompt's and each other's KV blocks
through the prefix cache (a block is kept once, ref-counted), so a step computes only the new
token of each beam. The finished candidates are ranked by vLLM's length-penalised score,
cum_logprob / len(tokens) ** length_penalty (tokens: prompt and output; a final EOS not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.lora.request import check_no_lora
from nanovllm.outputs import Logprob
from nanovllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's): `tokens` the prompt's and the generated ones, `logprobs` one
    {token id: Logprob} per generated token, `text` the generated text once finished."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0


@dataclass
class BeamSearchOutput:
    """The `beam_width` best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids, length_penalty: float) -> float:
    """vLLM's: the cumulative logprob over the beam's length to the power length_penalty."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / (length ** length_penalty)


def check_params(params: BeamSearchParams) -> None:
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"beam_search needs a BeamSearchParams, got {type(params).__name__}")
    for name in ("beam_width", "max_tokens"):
        value = getattr(params, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"BeamSearchParams.{name}={value!r}: must be an integer >= 1")


def beam_search(llm, prompts, params: BeamSearchParams, lora_request=None) -> list[BeamSearchOutput]:
    """The beam search of each prompt (text, token ids or a prompt dict; or one of them) on `llm`
    (see the module docstring); an adapter and bad `params` are refused before the first step."""
    check_no_lora(lora_request)
    prompts = [prompts] if isinstance(prompts, (str, dict)) else prompts
    prompt_ids = [llm._prompt(p)[0] for p in prompts]
    check_params(params)
    width, eos = params.beam_width, llm.eos_token_ids
    step_params = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=params.temperature, ignore_eos=True)
    live = [[BeamSearchSequence(list(ids), num_prompt_tokens=len(ids))] for ids in prompt_ids]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
    for _ in range(params.max_tokens):
        beams = [b for group in live for b in group]
        if not beams:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for b in beams], step_params, use_tqdm=False)
        by_beam = iter(outs)
        for p, group in enumerate(live):
            candidates = []
            for beam, out in zip(group, by_beam):
                for token, lp in out.outputs[0].logprobs[0].items():
                    candidates.append(BeamSearchSequence(beam.tokens + [token], beam.logprobs + [out.outputs[0].logprobs[0]],
                                                         beam.cum_logprob + lp.logprob,
                                                         num_prompt_tokens=beam.num_prompt_tokens))
            candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
            live[p] = []
            for c in candidates[:width]:
                if not params.ignore_eos and c.tokens[-1] in eos:
                    c.finish_reason = "stop"
                    done[p].append(c)
                else:
                    live[p].append(c)
    return [_best(llm, done[p] + live[p], params) for p in range(len(prompt_ids))]


def _best(llm, beams: list[BeamSearchSequence], params: BeamSearchParams) -> BeamSearchOutput:
    beams.sort(key=lambda b: beam_score(b, llm.eos_token_ids, params.length_penalty), reverse=True)
    best = beams[:params.beam_width]
    for b in best:
        b.finish_reason = b.finish_reason or "length"
        generated = b.tokens[b.num_prompt_tokens:]
        if llm.tokenizer is not None:
            keep = generated if params.include_stop_str_in_output or b.finish_reason != "stop" else generated[:-1]
            b.text = llm.tokenizer.decode(keep, skip_special_tokens=True)
    return BeamSearchOutput(best)
