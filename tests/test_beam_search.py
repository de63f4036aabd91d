"""LLM.beam_search (drop-in round 2) against a plain-torch beam search on transformers' model of
the same random weights (float32, CPU): the same beams in the same order with the same scores;
width 1 is greedy decoding; vLLM's example form with BeamSearchParams."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import assert_idle, greedy, hf_model  # noqa: E402

from nanovllm.beam_search import BeamSearchOutput  # noqa: E402
from nanovllm.sampling_params import BeamSearchParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@torch.no_grad()
def reference_beam_search(model, prompt: list[int], width: int, max_tokens: int, eos: set[int],
                          ignore_eos: bool, length_penalty: float) -> list[tuple[list[int], float]]:
    """vLLM's beam search, written out on transformers' logits: (tokens, cum_logprob), best first."""
    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
            top = torch.topk(logprobs, 2 * width)
            candidates += [(tokens + [t], cum + v) for t, v in zip(top.indices.tolist(), top.values.tolist())]
        candidates.sort(key=lambda c: c[1], reverse=True)
        live = []
        for tokens, cum in candidates[:width]:
            (done if not ignore_eos and tokens[-1] in eos else live).append((tokens, cum))
        if not live:
            break

    def score(c):
        return c[1] / ((len(c[0]) - (c[0][-1] in eos)) ** length_penalty)

    return sorted(done + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width, max_tokens, ignore_eos, length_penalty", [
    (1, 6, True, 1.0), (3, 5, True, 1.0), (4, 4, False, 0.5), (2, 7, False, 1.5)])
def test_beams_equal_a_plain_torch_beam_search(llm, ckpt, width, max_tokens, ignore_eos, length_penalty):
    model = hf_model(ckpt)
    prompts = [llm.tokenize("Hello, world!"), [5, 9, 11, 13]]
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos,
                              length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outs) == 2 and all(isinstance(o, BeamSearchOutput) for o in outs)
    for prompt, out in zip(prompts, outs):
        ref = reference_beam_search(model, prompt, width, max_tokens, set(llm.eos_token_ids), ignore_eos,
                                    length_penalty)
        assert [b.tokens for b in out.sequences] == [tokens for tokens, _ in ref]
        assert [b.cum_logprob for b in out.sequences] == pytest.approx([cum for _, cum in ref], abs=1e-4)
        for b in out.sequences:
            assert len(b.logprobs) == len(b.tokens) - len(prompt) and b.finish_reason in ("stop", "length")
    assert_idle(llm)


def test_width_one_is_greedy_decoding(llm):
    prompt = llm.tokenize("To be or not to be")
    beam = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))[0].sequences[0]
    plain = llm.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0]
    assert beam.tokens[len(prompt):] == plain.token_ids and beam.text == plain.text


def test_bad_beam_search_params_are_refused_before_any_work(llm):
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(["Hello"], BeamSearchParams(beam_width=0, max_tokens=4))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(["Hello"], greedy(4))
    with pytest.raises(ValueError, match="logprobs"):  # 2 x 11 candidates > max_logprobs (20)
        llm.beam_search(["Hello"], BeamSearchParams(beam_width=11, max_tokens=2))
    assert_idle(llm)
