"""Chat jobs and output constraints as job fields: GenerateRequest's rules, and Client.chat / AsyncClient.chat
enqueueing plain JSON RQ jobs that carry the messages (the worker renders them)."""

from __future__ import annotations

import asyncio

import pytest
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from rose.engine.chat import ChatTemplateError
from rose.engine.presets import build_tokenizer
from rose.jobs.async_client import AsyncClient
from rose.jobs.client import Client, InvalidRequest
from rose.jobs.schemas import GenerateRequest, ValidationError, format_validation_error

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def errors(**kwargs) -> str:
    with pytest.raises(ValidationError) as info:
        GenerateRequest(**kwargs)
    return format_validation_error(info.value)


def test_a_messages_job_renders_with_the_tokenizers_template():
    tok = build_tokenizer()
    req = GenerateRequest(messages=MESSAGES, max_tokens=4, chat_template_kwargs={"enable_thinking": False})
    prompt = req.engine_prompt(tok)
    assert prompt["prompt_token_ids"] == list(
        tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    )
    assert prompt["prompt"].endswith("<|assistant|>\n")
    cont = GenerateRequest(
        messages=[*MESSAGES, {"role": "assistant", "content": "hi"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert cont.engine_prompt(tok)["prompt"].endswith("<|assistant|>\nhi")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": "x", "messages": MESSAGES}, "got prompt and messages"),
        ({"prompt_token_ids": [1], "messages": MESSAGES}, "got prompt_token_ids and messages"),
        ({}, "give exactly one of 'prompt' (text), 'prompt_token_ids' (list of int) or 'messages'"),
        (
            {"prompt": "x", "chat_template_kwargs": {"a": 1}},
            "chat_template_kwargs only apply to 'messages' jobs",
        ),
        ({"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt only apply to 'messages'"),
        ({"prompt_token_ids": [1], "chat_template": "{{ x }}"}, "chat_template only apply"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only {'type': 'text'"),
        ({"messages": ["hi"]}, "messages.0: Input should be a valid dictionary"),
        ({"messages": MESSAGES, "continue_final_message": True}, "set add_generation_prompt=False"),
        ({"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, "may not set ['tokenize']"),
    ],
)
def test_chat_field_rules_name_the_problem(kwargs, message):
    assert message in errors(**kwargs)


def test_constraint_fields_are_checked_at_submit_time():
    assert (
        GenerateRequest(prompt="x", structured_outputs={"choice": ["a", "b"]}).constraint().kind == "choice"
    )
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    assert GenerateRequest(messages=MESSAGES, response_format=rf).constraint().kind == "json"
    assert "at most one of 'structured_outputs' and 'response_format'" in errors(
        prompt="x", structured_outputs={"regex": "a+"}, response_format={"type": "json_object"}
    )
    assert "exactly one of 'json', 'regex'" in errors(
        prompt="x", structured_outputs={"regex": "a", "choice": ["b"]}
    )
    assert "unknown keys ['jsn']" in errors(prompt="x", structured_outputs={"jsn": {}})
    assert "response_format.type must be" in errors(prompt="x", response_format={"type": "yaml"})


def test_a_template_problem_surfaces_when_rendering_not_at_submit():
    # the template is the worker's business: the job is valid, rendering it fails with the template's message
    req = GenerateRequest(messages=MESSAGES, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        req.engine_prompt(build_tokenizer())


def test_client_chat_enqueues_the_messages_as_given(fake_r):
    client = Client(fake_r, queue="rose")
    job = client.chat(
        MESSAGES,
        max_tokens=8,
        temperature=0.0,
        chat_template_kwargs={"enable_thinking": False},
        structured_outputs={"choice": ["yes", "no"]},
        job_timeout=30,
    )
    raw = RQJob.fetch(job.id, connection=fake_r, serializer=JSONSerializer)
    assert raw.func_name == "rose.jobs.generate" and raw.args == [] and raw.timeout == 30
    assert raw.kwargs == {
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0.0,
        "chat_template_kwargs": {"enable_thinking": False},
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    # the same as submit(messages=...), and submit_many takes messages dicts too
    assert client.submit(messages=MESSAGES).rq_job.kwargs == {"messages": MESSAGES}
    (many,) = client.submit_many([{"messages": MESSAGES}], max_tokens=3)
    assert many.rq_job.kwargs == {"messages": MESSAGES, "max_tokens": 3}


def test_client_chat_validates_before_enqueueing(fake_r):
    client = Client(fake_r, queue="rose")
    with pytest.raises(InvalidRequest, match="role must be one of"):
        client.chat([{"role": "bot", "content": "x"}])
    with pytest.raises(InvalidRequest, match="got prompt and messages"):
        client.submit("hello", messages=MESSAGES)
    with pytest.raises(InvalidRequest, match="structured_outputs.choice must be a non-empty list"):
        client.chat(MESSAGES, structured_outputs={"choice": []})
    assert fake_r.llen("rq:queue:rose") == 0


def test_async_client_chat(redis_server, r):
    async def go() -> dict:
        client = AsyncClient(redis_server.url, queue="rose")
        try:
            job = await client.chat(MESSAGES, max_tokens=2)
            return RQJob.fetch(job.id, connection=r, serializer=JSONSerializer).kwargs
        finally:
            await client.aclose()

    assert asyncio.run(go()) == {"messages": MESSAGES, "max_tokens": 2}
