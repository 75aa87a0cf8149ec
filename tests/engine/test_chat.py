"""Chat messages rendered with the tokenizer's own chat template (rose.engine.chat) and `LLM.chat`."""

from __future__ import annotations

import copy

import pytest
from engine_helpers import greedy, hf_greedy
from tokenizers import processors

from rose.engine.chat import ChatOptions, ChatTemplateError, render_chat
from rose.engine.llm import LLM
from rose.engine.presets import BOS, BOS_ID, build_preset

CONVERSATION = [
    {"role": "system", "content": "you are the queue worker"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "bonjour"},
    {"role": "user", "content": "merci rose"},
]
# Rejects the system role, as many models' templates do.
NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% else %}<think>{% endif %}"
)


@pytest.fixture(scope="module")
def bos_tokenizer(tokenizer):
    """The preset tokenizer, but its encode adds BOS (as Llama's does) while its template also writes one."""
    tok = copy.deepcopy(tokenizer)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    assert tok.encode("hello")[0] == BOS_ID
    return tok


def test_render_matches_the_tokenizers_own_apply_chat_template(tokenizer):
    rendered = render_chat(tokenizer, CONVERSATION)
    expected = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert rendered.prompt_token_ids == list(expected)
    assert rendered.prompt == tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    assert rendered.prompt.endswith("<|assistant|>\n")


def test_no_double_bos_when_encode_adds_one(bos_tokenizer):
    rendered = render_chat(bos_tokenizer, CONVERSATION)
    assert rendered.prompt.startswith(BOS)  # the template writes it
    assert rendered.prompt_token_ids.count(BOS_ID) == 1 and rendered.prompt_token_ids[0] == BOS_ID
    naive = bos_tokenizer.encode(rendered.prompt)
    assert naive[:2] == [BOS_ID, BOS_ID]  # what encoding the rendered text with special tokens would do
    assert rendered.prompt_token_ids == list(
        bos_tokenizer.apply_chat_template(
            CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )


def test_continue_final_message_leaves_the_last_turn_open(tokenizer):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the answer is"}]
    rendered = render_chat(
        tokenizer, messages, ChatOptions(add_generation_prompt=False, continue_final_message=True)
    )
    assert rendered.prompt.endswith("<|assistant|>\nthe answer is")
    closed = render_chat(tokenizer, messages, ChatOptions(add_generation_prompt=False))
    assert closed.prompt == rendered.prompt + tokenizer.eos_token + "\n"
    with pytest.raises(ChatTemplateError, match="add_generation_prompt=False"):
        ChatOptions(continue_final_message=True)


def test_chat_template_kwargs_reach_the_template(tokenizer):
    messages = [{"role": "user", "content": "hi"}]

    def render(**kwargs) -> str:
        options = ChatOptions(chat_template=THINKING_TEMPLATE, chat_template_kwargs=kwargs)
        return render_chat(tokenizer, messages, options).prompt

    assert render() == "hi<think>"
    assert render(enable_thinking=False) == "hi<nothink>"
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        ChatOptions(chat_template_kwargs={"add_generation_prompt": False})


def test_text_content_parts_are_joined(tokenizer):
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}
    ]
    plain = [{"role": "user", "content": "hello\nworld"}]
    assert render_chat(tokenizer, parts) == render_chat(tokenizer, plain)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "'image_url'"),
        ([{"role": "wizard", "content": "hi"}], "role must be one of"),
        ([{"role": "user"}], r"messages\[0\].content is missing"),
        ([], "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
    ],
)
def test_bad_messages_are_refused_with_the_reason(tokenizer, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(tokenizer, messages)


def test_no_chat_template_is_a_clear_error(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="tokenizer has no chat template"):
        render_chat(tok, [{"role": "user", "content": "hi"}])


def test_a_template_that_raises_is_a_chat_template_error(tokenizer):
    options = ChatOptions(chat_template=NO_SYSTEM_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        render_chat(tokenizer, CONVERSATION, options)
    ok = render_chat(tokenizer, CONVERSATION[1:], options)
    assert ok.prompt.startswith(BOS + "<|user|>")


# ----------------------------------------------------------------------------------------------- LLM.chat


@pytest.fixture(scope="module")
def reference():
    return build_preset("tiny-llama")[0]


@pytest.fixture(scope="module")
def llm():
    model, tok = build_preset("tiny-llama")
    return LLM(model, tok, device="cpu", max_num_seqs=4, max_model_len=96)


def test_llm_chat_equals_generate_on_the_rendered_prompt_and_hf_greedy(llm, reference):
    conversations = [CONVERSATION, [{"role": "user", "content": "hello"}]]
    outs = llm.chat(conversations, greedy(7))
    rendered = [render_chat(llm.get_tokenizer(), c) for c in conversations]
    plain = llm.generate(
        [{"prompt": r.prompt, "prompt_token_ids": r.prompt_token_ids} for r in rendered], greedy(7)
    )
    for out, ref, r in zip(outs, plain, rendered, strict=True):
        assert out.prompt == r.prompt  # the rendered text
        assert out.prompt_token_ids == r.prompt_token_ids
        assert (out.token_ids, out.text) == (ref.token_ids, ref.text)
        assert out.token_ids == hf_greedy(reference, r.prompt_token_ids, 7)
    # one conversation (not wrapped in a list) gives one output
    (single,) = llm.chat(conversations[1], greedy(7))
    assert single.token_ids == outs[1].token_ids


def test_llm_chat_options_and_errors(llm):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (out,) = llm.chat(messages, greedy(2), add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("<|assistant|>\nhello")
    (out,) = llm.chat(
        [{"role": "user", "content": "hi"}],
        greedy(2),
        chat_template=THINKING_TEMPLATE,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert out.prompt == "hi<nothink>"
    # a bad conversation among good ones: named by index, and nothing runs
    with pytest.raises(ChatTemplateError, match="conversation 1: .*System role not supported"):
        llm.chat([CONVERSATION[1:], CONVERSATION], greedy(2), chat_template=NO_SYSTEM_TEMPLATE)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ChatTemplateError, match="mixes message dicts and conversations"):
        llm.chat([CONVERSATION[0], CONVERSATION], greedy(2))
    with pytest.raises(ValueError, match="2 sampling_params for 1 conversations"):
        llm.chat(CONVERSATION, [greedy(2), greedy(3)])


def test_llm_chat_without_a_chat_template(tokenizer):
    model, _ = build_preset("tiny-llama")
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    llm = LLM(model, tok, device="cpu", max_num_seqs=2, max_model_len=64)
    with pytest.raises(ChatTemplateError, match="no chat template.*send a 'prompt'"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_llm_chat_renders_tools(tokenizer):
    """vLLM's `LLM.chat(..., tools=)`: the tools reach the template (rendering only; calls are the caller's to
    parse); malformed tools are refused before anything runs."""
    model, tok = build_preset("tiny-llama")
    llm = LLM(model, tok, device="cpu", max_num_seqs=2, max_model_len=1024)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    (out,) = llm.chat(messages, greedy(2), tools=tools)
    assert out.prompt == tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert '"name": "get_time"' in out.prompt and "<tool_call>" in out.prompt
    (plain,) = llm.chat(messages, greedy(2))
    assert "<tool_call>" not in plain.prompt
    with pytest.raises(ChatTemplateError, match=r"tools\[0\]\.type 'x' is an unknown tool type"):
        llm.chat(messages, greedy(2), tools=[{"type": "x"}])
    with pytest.raises(ChatTemplateError, match="may not set \\['tools'\\]"):
        llm.chat(messages, greedy(2), chat_template_kwargs={"tools": tools})
