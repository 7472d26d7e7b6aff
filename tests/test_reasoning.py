"""--reasoning-parser without a model: a whole answer's reasoning and content, and the same streamed in any cut
(speculative decoding sends several tokens a chunk, a tag may straddle two), for every parser."""

from __future__ import annotations

from pathlib import Path

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.chat_request import ChatMessage
from shared.structured import StructuredOutput, grammar_of, ll_tokenizer
from shared.tokenizer import Tokenizer
from services.gateway.reasoning.parser import FORMATS, ReasoningStream, StreamedReasoning, message_with_reasoning
from services.gateway.tags import opens_with

QWEN3, DEEPSEEK_R1, MISTRAL = FORMATS["qwen3"], FORMATS["deepseek_r1"], FORMATS["mistral"]
THOUGHT = "<think>\nThe user wants 2 + 2.\n\nThat is 4.\n</think>\n\nIt is 4."

# (format, answer, (reasoning, content))
WHOLE = [
    (QWEN3, THOUGHT, ("The user wants 2 + 2.\n\nThat is 4.", "It is 4.")),
    (DEEPSEEK_R1, THOUGHT, ("The user wants 2 + 2.\n\nThat is 4.", "It is 4.")),
    # The prompt opened the block: the answer starts inside it.
    (DEEPSEEK_R1, "The user wants 4.\n</think>\n\nIt is 4.", ("The user wants 4.", "It is 4.")),
    (QWEN3, "\n\n<think>\nhm\n</think>\nok", ("hm", "ok")),
    # No block: all answer for qwen3 (enable_thinking false), exactly as written; cut short inside the block.
    (QWEN3, "\nIt is 4.\n", (None, "\nIt is 4.\n")),
    (QWEN3, "<think>\nstill thinking", ("still thinking", None)),
    (DEEPSEEK_R1, "still thinking\n", ("still thinking", None)),
    (QWEN3, "<think>\n\n</think>\n\nIt is 4.", (None, "It is 4.")),  # an empty block
    (QWEN3, "Not <think> at the start", (None, "Not <think> at the start")),
    (QWEN3, "<think>a</think>b</think>c", ("a", "b</think>c")),  # only the first closing tag ends the block
    (QWEN3, "<thin", (None, "<thin")),
    # Magistral's tags, read as qwen3's are (tests/test_e2e_reasoning_mistral.py has them as control tokens)
    (MISTRAL, "[THINK]The user wants 4.\n[/THINK]\n\nIt is 4.", ("The user wants 4.", "It is 4.")),
    (MISTRAL, "It is 4. <think>no</think>", (None, "It is 4. <think>no</think>")),
    (MISTRAL, "[THINK]still", ("still", None)),
    (MISTRAL, "[THI", (None, "[THI")),
]


@pytest.mark.parametrize(("format", "answer", "expected"), WHOLE)
def test_a_whole_answer_splits_into_reasoning_and_content(format, answer, expected) -> None:
    assert format.split(answer) == expected


def _streamed(format, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(format)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@settings(max_examples=300, deadline=None)
@given(
    case=st.sampled_from(WHOLE),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=12),
)
def test_streamed_in_any_cut_it_reads_as_the_whole_answer(case, cuts) -> None:
    format, answer, (reasoning, content) = case
    points = sorted({min(c, len(answer)) for c in cuts})
    pieces = [answer[a:b] for a, b in zip([0, *points], [*points, len(answer)])]
    assert _streamed(format, pieces) == (reasoning or "", content or "")


def test_a_stream_sends_reasoning_as_it_comes_and_holds_back_only_what_may_be_a_tag() -> None:
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<thi", final=False) == ("", "")  # may open the block
    assert stream.feed("nk>\nStep one", final=False) == ("Step one", "")
    assert stream.feed(".\n</th", final=False) == (".", "")  # the line break may be layout before the tag
    assert stream.feed("ink>\n\nDone", final=False) == ("", "Done")
    assert stream.feed("!", final=True) == ("", "!")


def test_deltas_carry_reasoning_under_both_names_or_leave_it_out() -> None:
    chunk = {"index": 0, "delta": {"content": "<think>\nwhy\n</think>\n\nbecause"}, "finish_reason": "stop"}
    shown = StreamedReasoning(QWEN3, include=True).choice(chunk)
    assert shown["delta"] == {"content": "because", "reasoning": "why", "reasoning_content": "why"}
    hidden = StreamedReasoning(QWEN3, include=False).choice(chunk)
    assert hidden["delta"] == {"content": "because"}
    thinking = {"index": 1, "delta": {"role": "assistant", "content": "<think>\nwhy"}, "finish_reason": None}
    assert StreamedReasoning(QWEN3, include=True).choice(thinking)["delta"] == {
        "role": "assistant", "content": None, "reasoning": "why", "reasoning_content": "why"
    }


def test_a_whole_message_gets_its_reasoning_fields() -> None:
    message = {"role": "assistant", "content": THOUGHT}
    message_with_reasoning(message, QWEN3, include=True)
    assert message == {"role": "assistant", "content": "It is 4.", "reasoning": "The user wants 2 + 2.\n\nThat is 4.",
                       "reasoning_content": "The user wants 2 + 2.\n\nThat is 4."}
    hidden = {"role": "assistant", "content": THOUGHT}
    message_with_reasoning(hidden, QWEN3, include=False)
    assert hidden == {"role": "assistant", "content": "It is 4."}


def test_an_earlier_answers_reasoning_reaches_the_chat_template_under_the_name_templates_read() -> None:
    for name in ("reasoning", "reasoning_content"):
        message = ChatMessage.model_validate({"role": "assistant", "content": "It is 4.", name: "2 + 2"})
        assert message.for_template() == {"role": "assistant", "content": "It is 4.", "reasoning_content": "2 + 2"}


DEMO = Path(__file__).resolve().parents[1] / "models" / "specmesh-demo"
CONSTRAINTS = [
    (StructuredOutput(kind="json_schema", spec='{"type": "object", "properties": {"a": {"type": "integer"}}}'),
     '{"a":1}'),
    (StructuredOutput(kind="regex", spec="[a-z]+"), "abc"),
    (StructuredOutput(kind="choice", spec='["yes", "no"]'), "no"),
    (StructuredOutput(kind="grammar", spec='start: "x" | "y"'), "y"),
]


def _follows(structured: StructuredOutput, text: str) -> bool:
    tokenizer = Tokenizer(DEMO)
    ll = ll_tokenizer(DEMO, tokenizer.vocab_size, tuple(sorted(tokenizer.eos_token_ids)))
    matcher = llguidance.LLMatcher(ll, grammar_of(structured), log_level=0)
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and (
        matcher.is_accepting()
    )


@pytest.mark.parametrize(("constraint", "answer"), CONSTRAINTS, ids=[c.kind for c, _ in CONSTRAINTS])
def test_a_constraint_holds_for_the_answer_after_the_reasoning_block(constraint, answer) -> None:
    """vLLM's structured outputs under a reasoning parser: the model may think first, freely."""
    thought = "<think>\nA tag <tool_call> and a </th are text here.\n</think>\n\n"
    may_open = constraint.model_copy(update={"think_first": QWEN3.think_first})
    assert _follows(may_open, thought + answer) and _follows(may_open, answer)
    assert not _follows(may_open, "plain text, then " + answer)  # no block: the constraint from the first token
    inside = constraint.model_copy(update={"think_first": DEEPSEEK_R1.think_first})
    assert _follows(inside, "thinking, the prompt opened the block</think>\n" + answer)
    assert not _follows(inside, answer)  # the block the prompt opened closes before the answer
    assert not _follows(constraint, thought + answer)  # without a parser, from the first token
    # Up to two line breaks after the block, as templates write them, not endless ones a sample could spend its
    # budget on.
    assert not _follows(may_open, "<think>x</think>\n\n\n" + answer)
    assert len({c.key for c in (constraint, may_open, inside)}) == 3  # compiled and cached apart


def test_a_continued_message_is_inside_a_block_only_where_it_left_one_open() -> None:
    """continue_final_message: the answer goes on from the message, not from a prompt that opened a block."""
    prompt_end = "Assistant: <think>\n"  # a new answer's prompt would open a block: the continued one does not
    assert DEEPSEEK_R1.for_chat(prompt_end, "The answer is").split(" 42.") == (None, " 42.")
    assert QWEN3.for_chat(prompt_end, "<think>\nLet me see").split(", 6 x 7.</think>\n42") == (", 6 x 7.", "42")
    assert DEEPSEEK_R1.for_chat(prompt_end, "<think>a</think>The answer is").think_first == "may_open"


def test_the_end_of_the_prompt_says_whether_the_answer_thinks() -> None:
    """A template may open the block (the answer starts inside it) or hold it whole (Qwen3's enable_thinking false:
    no block to write, and an output constraint from the first token)."""
    assert QWEN3.for_chat("<|im_start|>assistant\n", None) is QWEN3
    assert DEEPSEEK_R1.for_chat("<｜Assistant｜>", None) is DEEPSEEK_R1
    opened = QWEN3.for_chat("<|im_start|>assistant\n<think>\n", None)
    assert opened.split("hm</think>\n\nok") == ("hm", "ok") and opened.think_first == "inside"
    for format in (QWEN3, DEEPSEEK_R1):
        closed = format.for_chat("<|im_start|>assistant\n<think>\n\n</think>\n\n", None)
        assert closed.split("<think>x</think>y") == (None, "<think>x</think>y") and closed.think_first is None


@pytest.mark.parametrize(
    ("text", "final", "blank", "opens"),
    [
        ("\n<think>x", False, "\n", True),
        ("\n <think>", False, "\n", False),  # a space is no layout for the reasoning parser
        ("\n <think>", False, None, True),  # but blank before a tool-call answer's block
        ("\n\n<thi", False, "\n", None),
        ("\n\n<thi", True, "\n", False),
        ("", False, None, None),
        ("<tool_call>", False, None, False),
    ],
)
def test_a_stream_opens_with_a_tag_once_its_pieces_tell(text: str, final: bool, blank: str | None,
                                                        opens: bool | None) -> None:
    assert opens_with(text, "<think>", final, blank) is opens


CONTROL_TAGS = MISTRAL.for_tokenizer({"[THINK]": 9, "[/THINK]": 10})  # the tags as control tokens


@pytest.mark.parametrize(("answer", "expected"), [
    ("[/THINK][/THINK]", (None, None)),  # a stray closing tag, no block
    ("[THINK]a[THINK]b[/THINK]c[/THINK]d[THINK]e", ("ab", "cde")),  # beyond the block's own tags
    ("x[THINK]y", (None, "xy")),
])
def test_control_token_tags_beyond_the_blocks_own_are_left_out(answer, expected) -> None:
    """The detokenizer keeps the tags for the parser alone: any it does not read as the block's are dropped, as they
    are from text no parser reads (vLLM's mistral parser drops them too). Tags that are text stay text."""
    assert CONTROL_TAGS.split(answer) == expected
    # Streamed in any cut, a tag's text included: a stop string the detokenizer holds back may cut one in two.
    for cut in range(len(answer) + 1):
        assert _streamed(CONTROL_TAGS, [answer[:cut], answer[cut:]]) == tuple(part or "" for part in expected), cut
    assert MISTRAL.split("x[THINK]y") == (None, "x[THINK]y")
