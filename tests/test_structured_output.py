"""Structured output in the engine, on the tiny test checkpoints: under a grammar, greedy output is the same for every
drafting method and equals transformers decoding step by step under the same mask; a sample is drawn from the
masked distribution (chi-square, with MTP drafts verified against it); a seeded sample does not depend on the batch;
tokens the grammar forces are drafted for free and all accepted; a draft the grammar forbids is never scored; a grammar
that does not compile is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import numpy as np
import pytest
import torch

from shared.structured import StructuredError, StructuredOutput, grammar_of, ll_tokenizer
from shared.tokenizer import model_eos_ids
from services.worker.drafting.draft import Draft
from services.worker.engine.sequence import Sequence
from services.worker.engine.outputs import SeqOutput, TokenLogprobs
from services.worker.grammar.constrain import advance, constrain_drafts
from services.worker.grammar.grammars import Grammars
from services.worker.grammar.token_mask import BITS, apply_token_mask
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    METHOD_NAMES, METHODS, encode_prompts, make_engine, make_request, model_dirs, mtp_model_dir, mtp_model_dirs,
    outputs_of, reference_model, run, single_thread, tiny_model_dir,
)

pytest.importorskip("transformers")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"},
                   "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"], "additionalProperties": False,
}
JSON_SCHEMA = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA))
MAX_TOKENS = 40


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask [rows, words] unpacked bit by bit, [rows, vocab] bool: the reference the engine's byte-table
    masking is checked against."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [rows, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _constrained(prompt, structured=JSON_SCHEMA, **sampling):
    return make_request(prompt, max_tokens=MAX_TOKENS, structured=structured, **sampling)


def _tokens(steps, request) -> list[int]:
    return [t for o in outputs_of(steps, request) for t in o.tokens]


@pytest.fixture(scope="module")
def prompt(tiny_model_dir) -> list[int]:  # noqa: F811
    return encode_prompts(tiny_model_dir, ["Give me a record: "])[0]


def _masked_greedy(model, model_dir: Path, prompt: list[int], structured: StructuredOutput, limit: int) -> list[int]:
    """transformers' greedy decoding, one token at a time, each chosen from the logits the grammar allows."""
    vocab = model.config.vocab_size
    tokenizer = ll_tokenizer(model_dir, vocab, tuple(sorted(model_eos_ids(model_dir))))
    matcher = llguidance.LLMatcher(tokenizer, grammar_of(structured))
    out: list[int] = []
    words = (vocab + 31) // 32
    while len(out) < limit and not matcher.is_stopped():
        with torch.no_grad():
            ids = torch.tensor([prompt + out])
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1:]  # [1, vocab]
        mask = torch.full((1, words), -1, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
        token = int(apply_token_mask(logits, mask, torch.tensor([0])).argmax())
        assert matcher.consume_token(token)
        out.append(token)
    return out


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_greedy_output_under_a_grammar_is_masked_step_by_step_decoding(
    name, model_dirs, prompt, reference_model, tiny_model_dir  # noqa: F811
) -> None:
    method = METHODS[name]
    engine = make_engine(model_dirs(method), method)
    request = _constrained(prompt, temperature=0.0)
    steps = run(engine, {0: [request]})
    tokens = _tokens(steps, request)
    assert tokens == _masked_greedy(reference_model, tiny_model_dir, prompt, JSON_SCHEMA, MAX_TOKENS)
    seq = outputs_of(steps, request)[-1].seq
    if len(tokens) < MAX_TOKENS:
        assert seq.finish_reason.name == "COMPLETE"  # the grammar completed: the object closed
    json.loads(engine.grammars.tokenizer.decode_str(tokens))


def test_forced_tokens_are_free_drafts_all_accepted(model_dirs, prompt) -> None:  # noqa: F811
    """Plain decoding (no drafter) still drafts what the schema fixes ({"name":", the keys, the braces)."""
    engine = make_engine(model_dirs(METHODS["naive"]), METHODS["naive"])
    request = _constrained(prompt, temperature=0.0)
    steps = run(engine, {0: [request]})
    seq = outputs_of(steps, request)[-1].seq
    assert seq.num_draft_tokens > 5 and seq.num_accepted_tokens == seq.num_draft_tokens
    assert len([o for o in outputs_of(steps, request) if o.tokens]) < len(_tokens(steps, request))


@pytest.mark.parametrize("name", ["ngram", "mtp"])
def test_a_seeded_sample_under_a_grammar_does_not_depend_on_the_batch(name, model_dirs, prompt) -> None:  # noqa: F811
    method = METHODS[name]
    alone_engine, batch_engine = (make_engine(model_dirs(method), method) for _ in range(2))
    options = dict(temperature=1.0, seed=3)
    alone = _constrained(prompt, **options)
    together = _constrained(prompt, **options)
    others = [_constrained(prompt, temperature=0.8, seed=s) for s in range(4)] + [make_request(prompt, max_tokens=20)]
    expected = _tokens(run(alone_engine, {0: [alone]}), alone)
    assert _tokens(run(batch_engine, {0: [together, *others]}), together) == expected


def _chi2(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the cells expected at least 5 times (the rest pooled into one)."""
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum() - 1)


def test_a_verified_mtp_draft_under_a_grammar_samples_the_masked_distribution(
    model_dirs, prompt, reference_model, tiny_model_dir  # noqa: F811
) -> None:
    """The regex forces its first token, so the second comes out of verification (MTP's drafts, masked q) and must
    follow the masked target: chi-square against transformers' masked softmax."""
    letters = "abcdefgh"
    structured = StructuredOutput(kind="regex", spec=f"x[{letters}]")
    method = METHODS["mtp"]
    engine = make_engine(model_dirs(method), method, max_num_seqs=32)
    num_samples = 400
    requests = [make_request(prompt, max_tokens=4, temperature=1.0, seed=s, structured=structured)
                for s in range(num_samples)]
    steps = run(engine, {0: requests})
    seconds = [_tokens(steps, r)[1] for r in requests]
    first = _tokens(steps, requests[0])[0]
    with torch.no_grad():
        ids = torch.tensor([prompt + [first]])
        logits = reference_model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1:]
    tokenizer = ll_tokenizer(tiny_model_dir, logits.shape[-1], tuple(sorted(model_eos_ids(tiny_model_dir))))
    matcher = llguidance.LLMatcher(tokenizer, grammar_of(structured))
    assert matcher.consume_token(first)
    words = (logits.shape[-1] + 31) // 32
    mask = torch.full((1, words), -1, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
    p = torch.softmax(apply_token_mask(logits, mask, torch.tensor([0]))[0], -1).numpy()
    options = allowed(mask, logits.shape[-1])[0].nonzero().flatten().numpy()
    assert set(seconds) <= set(options.tolist())
    observed = np.array([seconds.count(int(t)) for t in options], dtype=float)
    statistic, dof = _chi2(observed, p[options] / p[options].sum() * num_samples)
    assert statistic < 3 * dof + 15, (statistic, dof)  # far above a 0.999 quantile: a wrong q would be way off
    assert sum(o.seq.num_draft_tokens for r in requests for o in outputs_of(steps, r)[-1:]) > 0


def test_a_forbidden_draft_and_those_after_it_are_dropped(tiny_model_dir, prompt) -> None:  # noqa: F811
    grammars = Grammars(tiny_model_dir, _vocab(tiny_model_dir), model_eos_ids(tiny_model_dir))
    structured = StructuredOutput(kind="regex", spec="(ab|ac)d+")
    seq = Sequence("0" * 32, prompt, make_request(prompt, structured=structured).sampling, 0, frozenset())
    grammars.attach(seq)
    tok = grammars.tokenizer
    a, b, c, d = (tok.tokenize_str(x)[0] for x in "abcd")
    assert not grammars.forced(seq)  # "a" is certain, but as "a", "ab" or "ac": no one token is forced
    seq.output_ids.append(a)
    assert not grammars.advance(seq, [a])
    (kept,) = constrain_drafts(grammars, [seq], [Draft([b, d, c, d])], max_model_len=64, max_forced=8)
    assert kept.tokens == [b, d]  # c after "abd" breaks the grammar: it and what follows go
    bitmask, rows = grammars.masks([seq], [kept.tokens], width=3)
    assert rows.tolist() == [0, 1, 2]
    options = [allowed(bitmask, _vocab(tiny_model_dir))[r].nonzero().flatten().tolist() for r in range(3)]
    assert b in options[0] and c in options[0] and d not in options[0]
    assert d in options[2]


def test_what_a_schema_fixes_is_forced(tiny_model_dir, prompt) -> None:  # noqa: F811
    grammars = Grammars(tiny_model_dir, _vocab(tiny_model_dir), model_eos_ids(tiny_model_dir))
    seq = Sequence("0" * 32, prompt, make_request(prompt, structured=JSON_SCHEMA).sampling, 0, frozenset())
    grammars.attach(seq)
    assert grammars.tokenizer.decode_str(grammars.forced(seq)) == '{"name":'  # the quote may start a token


def _vocab(model_dir: Path) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def test_a_grammar_that_does_not_compile_is_refused_by_name(model_dirs, prompt) -> None:  # noqa: F811
    engine = make_engine(model_dirs(METHODS["ngram"]), METHODS["ngram"])
    broken = StructuredOutput(kind="json_schema", spec=json.dumps({"type": "objekt"}))
    with pytest.raises(StructuredError, match="objekt"):
        engine.add_request(_constrained(prompt, structured=broken))
    assert not engine.has_work()


def test_a_resumed_request_continues_its_grammar(model_dirs, prompt) -> None:  # noqa: F811
    method = METHODS["ngram"]
    whole_engine, resumed_engine = (make_engine(model_dirs(method), method) for _ in range(2))
    whole = _constrained(prompt, temperature=0.0)
    tokens = _tokens(run(whole_engine, {0: [whole]}), whole)
    resumed = make_request(prompt, tokens[:7], max_tokens=MAX_TOKENS, temperature=0.0, structured=JSON_SCHEMA)
    assert _tokens(run(resumed_engine, {0: [resumed]}), resumed) == tokens[7:]


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [1, 4]])
def test_a_bitmask_forbids_exactly_its_cleared_bits(rows) -> None:
    vocab = 1000
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(6, vocab)
    index = torch.tensor(rows)
    expected = logits.clone()
    expected[index] = expected[index].masked_fill(~allowed(bitmask, vocab), float("-inf"))
    assert torch.equal(apply_token_mask(logits, bitmask, index), expected)


def test_an_end_the_grammar_allows_mid_way_ends_the_output_once(tiny_model_dir, prompt) -> None:  # noqa: F811
    """"yes" may end or go on to "yes please": a step that emits "yes" and the end token feeds each token to the
    grammar once and ends STOP; one that completes "yes please" and then the end ends COMPLETE without it."""
    grammars = Grammars(tiny_model_dir, _vocab(tiny_model_dir), model_eos_ids(tiny_model_dir))
    structured = StructuredOutput(kind="choice", spec='["yes", "yes please"]')
    (eos,) = model_eos_ids(tiny_model_dir)
    for text, reason, emitted in (("yes", "STOP", True), ("yes please", "COMPLETE", False)):
        seq = Sequence("0" * 32, prompt, make_request(prompt, structured=structured).sampling, 0, frozenset({eos}))
        grammars.attach(seq)
        tokens = grammars.tokenizer.tokenize_str(text) + [eos]
        seq.append(tokens, 256)  # as accept() does: the end token finishes it, STOP
        out = SeqOutput(seq, 0, list(tokens), TokenLogprobs.tokens_only(tokens, 0))
        advance(grammars, [out])
        assert seq.finish_reason.name == reason
        assert (out.tokens[-1] == eos) == emitted and (seq.output_ids[-1] == eos) == emitted


def test_an_end_the_grammar_allows_under_ignore_eos_completes_the_output(tiny_model_dir, prompt) -> None:  # noqa: F811
    """Under ignore_eos the end token is no stop token: "yes" then the end, drafted "yes" or not, completes the
    grammar there (COMPLETE, the end emitted) instead of leaving a stopped grammar to mask the next step."""
    (eos,) = model_eos_ids(tiny_model_dir)
    choice = StructuredOutput(kind="choice", spec='["yes", "yes please"]')
    outputs = []
    for grammar_drafts in (True, False):
        engine = make_engine(tiny_model_dir, METHODS["naive"], grammar_drafts=grammar_drafts)
        request = make_request(prompt, max_tokens=20, temperature=0.0, structured=choice, ignore_eos=True,
                               logit_bias={eos: 100.0})
        outs = outputs_of(run(engine, {0: [request]}), request)
        assert outs[-1].seq.finish_reason.name == "COMPLETE"
        outputs.append(_tokens([outs], request))
    assert outputs[0] == outputs[1] and outputs[0][-1] == eos


def test_what_a_step_emits_past_a_complete_grammar_is_not_emitted(tiny_model_dir, prompt) -> None:  # noqa: F811
    """A draft that completes the grammar leaves its bonus row nothing but the end, which min_tokens forbids: the
    token drawn there is whatever the masked-out row gave. It is dropped, as step-by-step decoding never draws it."""
    grammars = Grammars(tiny_model_dir, _vocab(tiny_model_dir), model_eos_ids(tiny_model_dir))
    structured = StructuredOutput(kind="choice", spec='["yes please"]')
    (eos,) = model_eos_ids(tiny_model_dir)
    seq = Sequence("0" * 32, prompt, make_request(prompt, structured=structured).sampling, 0, frozenset({eos}))
    grammars.attach(seq)
    words = grammars.tokenizer.tokenize_str("yes please")
    tokens = words + [eos + 1]  # a token the complete grammar forbids
    seq.append(tokens, 256)
    out = SeqOutput(seq, 0, list(tokens), TokenLogprobs.tokens_only(tokens, 0), num_accepted=len(words))
    advance(grammars, [out])
    assert seq.finish_reason.name == "COMPLETE" and out.tokens == words == seq.output_ids
    assert out.num_accepted == len(words)


def test_an_aborted_waiting_request_lets_its_grammar_go(model_dirs, prompt) -> None:  # noqa: F811
    engine = make_engine(model_dirs(METHODS["naive"]), METHODS["naive"])
    request = _constrained(prompt)
    engine.add_request(request)
    assert engine.grammars.active
    engine.abort(request.request_id)
    assert not engine.grammars.active


def test_a_choice_grammar_matches_exactly_its_strings(tiny_model_dir) -> None:  # noqa: F811
    """Choices compile to one regex alternation: characters that are regex syntax elsewhere match themselves."""
    tokenizer = ll_tokenizer(tiny_model_dir, _vocab(tiny_model_dir), tuple(sorted(model_eos_ids(tiny_model_dir))))
    choices = ["a.b", "(x)|y", "\\d+", "[z]{2}^$", "two words\n", "naïve", ""]
    grammar = grammar_of(StructuredOutput(kind="choice", spec=json.dumps(choices)))
    for text, matches in [*((c, True) for c in choices), ("axb", False), ("x", False), ("7", False), ("zz", False)]:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        consumed = matcher.consume_tokens(tokenizer.tokenize_str(text))
        assert (consumed and matcher.is_accepting()) == matches, text


@pytest.mark.parametrize("name", ["naive", "ngram"])
def test_thousands_of_choices_are_served(name, model_dirs, prompt) -> None:  # noqa: F811
    """Past 2,000 alternatives llguidance's parser refuses the first token of a rule of one alternative each; the
    choices' one regex has no such bound."""
    choices = [f"choice number {i}" for i in range(5_000)]
    engine = make_engine(model_dirs(METHODS[name]), METHODS[name])
    request = _constrained(prompt, StructuredOutput(kind="choice", spec=json.dumps(choices)), temperature=0.0)
    steps = run(engine, {0: [request]})
    text = engine.grammars.tokenizer.decode_str(_tokens(steps, request))
    assert text in choices and outputs_of(steps, request)[-1].seq.finish_reason.name == "COMPLETE"


@pytest.mark.parametrize("name", ["naive", "ngram"])
def test_a_grammar_failing_at_run_time_ends_its_request_alone(name, model_dirs, prompt) -> None:  # noqa: F811
    """A rule of more alternatives than llguidance's parser holds in a row compiles, then fails at the first token
    fed to it: that request finishes CONSTRAINT_FAILED, and the step, and its batch, go on as if it were not there."""
    engine = make_engine(model_dirs(METHODS[name]), METHODS[name])
    wide = StructuredOutput(kind="grammar", spec="start: " + " | ".join(f'"w{i}"' for i in range(3_000)))
    failing = _constrained(prompt, wide, temperature=0.0)
    plain = make_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    steps = run(engine, {0: [failing, plain]})
    assert outputs_of(steps, failing)[-1].seq.finish_reason.name == "CONSTRAINT_FAILED"
    assert not engine.grammars.active
    alone = make_engine(model_dirs(METHODS[name]), METHODS[name])
    assert _tokens(steps, plain) == _tokens(run(alone, {0: [plain]}), plain)
