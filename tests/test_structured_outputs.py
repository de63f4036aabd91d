"""Structured outputs (features/structured/) on CPU: a tiny random Qwen3 with a byte-level BPE
tokenizer (tests/tiny_model.py), so any JSON can be spelled. Outputs are checked by independent
readers: `json` + `jsonschema` for schemas, `re.fullmatch` for regexes; random weights write
whatever the mask allows, so every path of the grammars gets exercised."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402
from triton_caches import compiled_variants  # noqa: E402
from helpers import make_llm, rand_ids  # noqa: E402

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.features.structured.masks import StructuredOutputs, apply_bitmask  # noqa: E402
from nanovllm.sampling_params import StructuredOutputsParams as S  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {  # nested objects, bounded arrays, enums, an optional field
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                   "role": {"enum": ["admin", "guest"]}},
                 "required": ["id", "role"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                   "minItems": 1, "maxItems": 4},
        "note": {"type": "string", "maxLength": 5}},
     "required": ["user", "scores"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"const": "point"},
                                      "tag": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["ok", "kind", "tag"]},
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return make_llm(tm.make_tiny_qwen3(tmp_path_factory.mktemp("structured"), num_layers=2, seed=11))


def parse(text: str):
    """JSON as Python reads it, but for raw control characters in strings: xgrammar's rule for
    length-bounded strings ([^"\\\r\n]{0,n}) lets them through, which strict JSON forbids."""
    return json.loads(text, strict=False)


def texts(llm, prompts, **kw):
    kw.setdefault("max_tokens", 160)
    outs = llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)
    return [(c.text, c.finish_reason) for o in outs for c in o.outputs]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_parse_and_validate(llm, schema):
    so = S(json=json.dumps(schema), disable_any_whitespace=True)
    for text, reason in texts(llm, ["a", "bcd", "efgh ij"], temperature=1.0, seed=3, structured_outputs=so):
        assert reason == "stop", text  # the grammar was completed, then EOS (the only token allowed)
        jsonschema.validate(parse(text), schema)


def test_regex_choice_and_any_json_object(llm):
    for text, _ in texts(llm, ["x", "yz"], temperature=1.0, seed=5,
                         structured_outputs=S(regex=r"[a-z]{2,4}-\d{3}( ok)?")):
        assert re.fullmatch(r"[a-z]{2,4}-\d{3}( ok)?", text), text
    choices = ["red", "green", "blue sky"]
    for text, _ in texts(llm, ["x", "yz", "pq"], temperature=1.0, seed=6, structured_outputs=S(choice=choices)):
        assert text in choices
    grammar = 'root ::= "(" digit ("," digit)* ")"\ndigit ::= [0-9]'
    for text, _ in texts(llm, ["q"], temperature=1.0, seed=2, structured_outputs=S(grammar=grammar)):
        assert re.fullmatch(r"\(\d(,\d)*\)", text), text
    for text, reason in texts(llm, ["x"], temperature=1.0, seed=8, max_tokens=300,
                              structured_outputs=S(json_object=True, disable_any_whitespace=True)):
        assert reason == "length" or isinstance(parse(text), dict), text


def test_constrained_rows_leave_the_others_unchanged(llm):
    """In one batch: greedy unconstrained rows get the tokens they get alone; constrained rows
    still fit; n = 2 samples of a constrained request each fit on their own."""
    prompts = [rand_ids(7, i) for i in range(3)]
    alone = [list(o.outputs[0].token_ids) for o in
             llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    so = S(json=SCHEMAS[0], disable_any_whitespace=True)
    mixed = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(structured_outputs=so, max_tokens=80, n=2),
             SamplingParams(temperature=0, max_tokens=12), SamplingParams(structured_outputs=so, max_tokens=80, seed=4)]
    outs = llm.generate([prompts[0], prompts[1], prompts[2], prompts[1]], mixed, use_tqdm=False)
    assert [list(outs[i].outputs[0].token_ids) for i in (0, 2)] == [alone[0], alone[2]]
    for o in (outs[1], outs[3]):
        for c in o.outputs:
            jsonschema.validate(parse(c.text), SCHEMAS[0])
    # Seeded: the same tokens whatever the batch around it.
    again = llm.generate([prompts[1]], SamplingParams(structured_outputs=so, max_tokens=80, seed=4), use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[3].outputs[0].token_ids


def test_preemption_keeps_the_matcher_in_step(tmp_path):
    """A KV cache too small for every request at once: requests are preempted and recomputed
    mid-output, and their outputs still fit (the matcher follows the kept tokens)."""
    llm = make_llm(tm.make_tiny_qwen3(tmp_path / "m", num_layers=2, seed=12), num_kvcache_blocks=12, max_num_seqs=8)
    so = S(json=SCHEMAS[1], disable_any_whitespace=True)
    prompts = [rand_ids(30, i) for i in range(6)]
    for text, reason in texts(llm, prompts, temperature=1.0, seed=1, structured_outputs=so, max_tokens=90):
        assert reason == "stop", text
        jsonschema.validate(parse(text), SCHEMAS[1])
    assert llm.scheduler.num_preemptions > 0, "the test meant to force preemption but none happened"


@pytest.mark.parametrize("so, match", [
    (S(json='{"type": "objekt"}'), "structured_outputs.json: .*objekt"),
    (S(json="{not json"), "not valid JSON"),
    (S(regex="(ab"), "structured_outputs.regex: .*parenthesis"),
    (S(grammar="root ::= missing"), "structured_outputs.grammar: .*missing"),
    (S(choice=[]), "non-empty list"),
    (S(regex="a", choice=["a"]), "exactly one of"),
    (S(), "exactly one of"),
])
def test_bad_constraints_are_refused_before_any_work(llm, so, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["x", "y"], [SamplingParams(), SamplingParams(structured_outputs=so)], use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    assert texts(llm, ["x"], temperature=0, max_tokens=3)[0][1] == "length"  # the engine still runs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("some_rows", [True, False])
def test_apply_bitmask_against_a_loop(device, some_rows):
    """The mask (plain torch on CPU, xgrammar's Triton kernel on CUDA) against a per-token loop,
    on some rows of a batch or all; fresh random bits each run."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator()
    seed = gen.seed()
    vocab, rows = 77, torch.tensor([0, 2, 3] if some_rows else [0, 1, 2, 3])
    bits = torch.randint(-2**31, 2**31 - 1, (len(rows), 3), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(4, vocab, generator=gen)
    want = logits.clone()
    for i, r in enumerate(rows.tolist()):
        for t in range(vocab):
            if not (int(bits[i, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    got = logits.to(device)
    apply_bitmask(got, rows.to(device), bits.to(device))
    assert torch.equal(got.cpu(), want), seed


def test_ignore_eos_runs_on_unconstrained_after_the_grammar_is_complete(llm, caplog):
    """A complete value leaves only EOS; with ignore_eos the output goes on, free (the matcher is
    done), and no token is reported as breaking the grammar."""
    eos = sorted(llm.eos_token_ids)
    with caplog.at_level("WARNING", logger="nanovllm.features.structured.masks"):
        out = llm.generate(["x"], SamplingParams(structured_outputs=S(choice=["yes"]), ignore_eos=True, max_tokens=8,
                                                 temperature=1.0, seed=3), use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    first_eos = next(i for i, t in enumerate(ids) if t in eos)
    assert llm.tokenizer.decode(ids[:first_eos]) == "yes" and len(ids) == 8
    assert "does not fit" not in caplog.text


def test_speculative_decoding_keeps_constrained_outputs_exact(tmp_path, monkeypatch):
    """Drafted positions are masked as plain decoding masks them after the drafts before them:
    with an oracle proposer (plain decoding's own continuation, one draft spoilt in turn, also
    into a token the grammar refuses) every seed gives the tokens plain decoding gives, and
    drafts are kept."""
    from nanovllm.features.speculative.ngram import NgramProposer
    from nanovllm.features.speculative.drafting import draft_counts

    path = tm.make_tiny_qwen3(tmp_path / "m", num_layers=2, seed=13)
    plain, spec = make_llm(path), make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    so = S(json=SCHEMAS[1], disable_any_whitespace=True)
    prompts = [rand_ids(9, i) for i in range(4)]
    params = [SamplingParams(structured_outputs=so, max_tokens=60, temperature=t, seed=i)
              for i, t in enumerate((0.0, 1.0, 0.7, 1.0))]
    want = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    reference, calls = {tuple(p): w for p, w in zip(prompts, want)}, [0]
    brace = plain.tokenizer.encode("}", add_special_tokens=False)[0]

    def propose(self, seq, k):
        done = seq.num_completion_tokens
        d = list(reference[tuple(seq.token_ids[:seq.num_prompt_tokens])][done:done + k])
        spoil, calls[0] = calls[0] % (k + 2), calls[0] + 1
        if spoil < len(d):
            d[spoil] = brace if spoil % 2 else (d[spoil] + 1) % 400
        return d

    monkeypatch.setattr(NgramProposer, "propose_one", propose)
    counts = draft_counts(spec.scheduler)
    got = [list(o.outputs[0].token_ids) for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert counts.num_drafts > 0 and counts.num_accepted_tokens > 0


def test_tensor_parallelism_masks_on_rank_0(tmp_path):
    """TP = 2 (gloo): constrained rows sample on rank 0 from the gathered logits with the same
    mask; the tokens equal one rank's."""
    path = tm.make_tiny_qwen3(tmp_path / "m", num_layers=2, seed=14)
    so = S(json=SCHEMAS[1], disable_any_whitespace=True)
    params = [SamplingParams(structured_outputs=so, max_tokens=70, temperature=1.0, seed=s) for s in range(3)]
    params.append(SamplingParams(temperature=0, max_tokens=10))  # beside an unconstrained row
    prompts = [rand_ids(8, i) for i in range(4)]
    with make_llm(path) as one:
        want = [list(o.outputs[0].token_ids) for o in one.generate(prompts, params, use_tqdm=False)]
    with make_llm(path, tensor_parallel_size=2) as two:
        outs = two.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    for o in outs[:3]:
        jsonschema.validate(parse(o.outputs[0].text), SCHEMAS[1])


@pytest.mark.gpu
def test_constrained_rows_on_gpu_with_graphs(tmp_path):
    """On CUDA with decode graphs and overlap scheduling (the host reads each row's newest token
    from the sampler's pinned copy): outputs fit, beside unconstrained rows, and seeded runs
    repeat."""
    path = tm.make_tiny_qwen3(tmp_path / "m", num_layers=2, seed=15, dtype=torch.bfloat16)
    llm = make_llm(path, num_kvcache_blocks=512)
    so = S(json=SCHEMAS[1], disable_any_whitespace=True)
    params = [SamplingParams(structured_outputs=so, max_tokens=120, temperature=1.0, seed=s) for s in range(24)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=40) for s in range(8)]
    prompts = [rand_ids(10 + i, i) for i in range(32)]
    first = llm.generate(prompts, params, use_tqdm=False)
    for o in first[:24]:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(parse(o.outputs[0].text), SCHEMAS[1])
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    # xgrammar's mask kernel: the variants the extension compiled when it was made serve every
    # batch size (nothing compiles in a step).
    from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_kernel as kernel
    ext = next(e for e in llm.model_runner.sampler.processing.extensions if isinstance(e, StructuredOutputs))
    vocab, before = ext.grammars.info.vocab_size, compiled_variants(kernel)
    for n in (2, 5, 32, 33, 200):
        bits = torch.full((n, (vocab + 31) // 32), -1, dtype=torch.int32, device="cuda")
        apply_bitmask(torch.zeros(n, vocab, device="cuda"), torch.arange(n, device="cuda"), bits)
    assert compiled_variants(kernel) == before
    llm.shutdown()


def test_min_tokens_never_leaves_a_complete_grammar_nothing_to_sample(llm):
    """min_tokens suppresses EOS, but a complete value allows only EOS: the row then takes it
    (the output stays the grammar's) instead of sampling a masked token."""
    for temperature in (0.0, 1.0):
        out = llm.generate(["x"], SamplingParams(structured_outputs=S(choice=["yes"]), min_tokens=4, max_tokens=10,
                                                 temperature=temperature, seed=1), use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason) == ("yes", "stop")


def test_choices_outside_the_basic_plane_and_with_escapes(llm):
    choices = ["ok 😀", 'a"b', "c\\d", "tab\there"]
    for text, _ in texts(llm, ["x", "yz", "pq", "rs"], temperature=1.0, seed=2, structured_outputs=S(choice=choices)):
        assert text in choices


def test_reasoning_end_drafted_by_speculative_decoding_starts_the_grammar(tmp_path, monkeypatch):
    """The constraint starts after </think>; when </think> comes as a draft, the rows after it
    are masked from the grammar's start (an oracle proposer drafting plain decoding's own
    continuation keeps every draft: the tokens must be plain decoding's)."""
    from nanovllm.features.speculative.drafting import draft_counts
    from nanovllm.features.speculative.ngram import NgramProposer

    path = tm.make_tiny_qwen3(tmp_path / "m", num_layers=2, seed=13)
    prompt = rand_ids(6, 1214)  # (greedy output writes </think> at position 10 on this model)

    def params():
        so = S(regex=r"[0-9]{3,}")
        so._reasoning_end = "</think>"  # as the server's --reasoning-parser sets it
        return SamplingParams(structured_outputs=so, max_tokens=20, temperature=0.0)

    plain = make_llm(path)
    want = list(plain.generate([prompt], params(), use_tqdm=False)[0].outputs[0].token_ids)
    end = plain.tokenizer.convert_tokens_to_ids("</think>")
    assert end in want and re.fullmatch(r"[0-9]{3,}", plain.tokenizer.decode(want[want.index(end) + 1:],
                                                                           skip_special_tokens=True))
    spec = make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    monkeypatch.setattr(NgramProposer, "propose_one", lambda self, seq, k: list(
        want[seq.num_completion_tokens:seq.num_completion_tokens + k]))
    assert list(spec.generate([prompt], params(), use_tqdm=False)[0].outputs[0].token_ids) == want
    assert draft_counts(spec.scheduler).num_accepted_tokens > 0


def test_data_parallel_replicas_constrain_their_rows(tmp_path):
    path = tm.make_tiny_qwen3(tmp_path / "m", num_layers=2, seed=16)
    with make_llm(path, data_parallel_size=2) as llm:
        outs = llm.generate(["x", "y", "z", "w"], SamplingParams(structured_outputs=S(choice=["yes", "no"]),
                                                                 temperature=1.0, seed=3, max_tokens=10), use_tqdm=False)
        assert all(o.outputs[0].text in ("yes", "no") for o in outs)
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            llm.generate(["x"], SamplingParams(structured_outputs=S(regex="(a")), use_tqdm=False)
