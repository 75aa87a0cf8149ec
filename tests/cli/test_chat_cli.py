"""`rose generate --chat`, `rose submit --messages`, and the chat / output-constraint flags (rose.cli.request_args):
real subprocesses, and the flags' mapping onto job fields."""

from __future__ import annotations

import json

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from rose import LLM, SamplingParams
from rose.cli import build_parser
from rose.cli.request_args import chat_kwargs, constraint_kwargs, request_kwargs, tool_kwargs

pytestmark = pytest.mark.timeout(300)

GREEDY = ("--temperature", "0", "--max-tokens", "6", "--ignore-eos")
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-llama", device="cpu", max_num_seqs=2)


def chat_text(llm: LLM, messages: list[dict]) -> str:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return llm.chat(messages, params)[0].text


def test_generate_chat_renders_each_prompt_as_its_own_conversation(rose, llm) -> None:
    res = rose("generate", "--device", "cpu", "--chat", "--system", "be brief", *GREEDY, "Hello", "merci")
    assert res.returncode == 0, res.stderr
    first = chat_text(llm, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}])
    second = chat_text(llm, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "merci"}])
    assert first != second
    assert res.stdout == (
        f"[0] 'Hello' -> length, 6 tokens\n{first}\n\n[1] 'merci' -> length, 6 tokens\n{second}\n"
    )
    # plain generation of the same text is something else: the template was applied
    assert (
        llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].text != first
    )


def test_generate_chat_stream_prints_the_reply(llm, capsys) -> None:
    from rose.cli import main

    capsys.readouterr()  # the same main as the subprocess above, in this process: seconds of imports fewer
    assert main(["generate", "--device", "cpu", "--chat", "--stream", *GREEDY, "Hello"]) == 0
    assert capsys.readouterr().out == chat_text(llm, [{"role": "user", "content": "Hello"}]) + "\n"


def test_generate_chat_options_need_chat(rose) -> None:
    res = rose("generate", "--system", "x", "--chat-template-kwargs", '{"enable_thinking": false}', "Hello")
    assert res.returncode == 2
    assert "--system, --chat-template-kwargs: needs --chat" in res.stderr


def test_submit_messages_runs_a_chat_job(rose, cli_worker, llm, tmp_path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Bonjour"}]
    expected = chat_text(llm, messages)
    res = rose("submit", "--messages", json.dumps(messages), *GREEDY)
    assert res.returncode == 0, res.stderr
    job_id, text, usage = res.stdout.rstrip("\n").split("\n")
    assert text == expected and "completion_tokens=6" in usage
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(messages))
    res = rose("submit", "--messages", f"@{path}", "--stream", *GREEDY)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[1] == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--messages", '[{"role": "bot", "content": "x"}]'), "messages[0].role must be one of"),
        (("--messages", "[{bad"), "argument --messages: the value is not valid JSON"),
        (("--messages", "@/nonexistent/m.json"), "cannot read /nonexistent/m.json"),
        (("--messages", '[{"role": "user", "content": "x"}]', "Hello"), "give a PROMPT or --messages"),
        ((), "give a PROMPT or --messages"),
        (("--chat-template-kwargs", "{}", "Hello"), "chat_template_kwargs only apply to 'messages' jobs"),
        (("--choice", "a", "--regex", "b", "Hello"), "not allowed with argument"),
        (("--json-schema", "[1]", "Hello"), "--json-schema: structured_outputs.json must be a JSON schema"),
        (("--tools", "{}", "Hello"), "argument --tools: must be a JSON list"),
        (("--tools", json.dumps(TOOLS), "Hello"), "tools only apply to 'messages' jobs"),
        (
            (
                "--messages",
                '[{"role": "user", "content": "x"}]',
                "--tools",
                json.dumps(TOOLS),
                "--tool-choice",
                "f",
            ),
            "tool_choice names an unknown tool 'f': tools are get_weather",
        ),
    ],
)
def test_submit_usage_errors_enqueue_nothing(rose, args, message) -> None:
    # The Redis URL points nowhere: these are refused before any connection.
    res = rose("submit", "--redis-url", "redis://127.0.0.1:1/0", *args)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and res.stdout == ""


def test_submit_constraint_and_chat_flags_become_job_fields(rose, cli_redis, tmp_path) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    messages = [{"role": "user", "content": "hi"}]
    # a queue nobody serves: the job stays queued and the command gives up waiting at once
    res = rose(
        "submit", "--queue", "nobody-serves-this", "--timeout", "0.1", "--messages", json.dumps(messages),
        "--json-schema", f"@{tmp_path / 'schema.json'}", "--chat-template-kwargs", '{"enable_thinking": false}',
        "--max-tokens", "7",
    )  # fmt: skip
    assert res.returncode == 124, res.stderr
    job = Job.fetch(res.stdout.split("\n")[0], connection=cli_redis.client(), serializer=JSONSerializer)
    assert job.kwargs == {
        "messages": messages,
        "max_tokens": 7,
        "chat_template_kwargs": {"enable_thinking": False},
        "structured_outputs": {"json": schema},
    }


def test_submit_tools_prints_the_calls(rose, cli_worker, tmp_path) -> None:
    """--tools / --tool-choice (a function's name): the calls are printed after the text, also with --stream."""
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    messages = json.dumps([{"role": "user", "content": "Weather in Paris?"}])
    args = ("--messages", messages, "--tools", f"@{tmp_path / 'tools.json'}", "--tool-choice", "get_weather")
    for extra in ((), ("--stream",)):
        res = rose("submit", *args, "--temperature", "0", "--max-tokens", "32", *extra)
        assert res.returncode == 0, res.stderr
        job_id, text, call, usage = res.stdout.rstrip("\n").split("\n")
        assert call.startswith("[tool_call id=call_") and f"name=get_weather arguments={text}]" in call
        assert json.loads(text)["city"] in ("Paris", "Lyon") and "finish_reason=stop" in usage


def test_tool_flags_map_to_tool_fields() -> None:
    def tool_fields(*argv: str) -> dict:
        return tool_kwargs(build_parser().parse_args(["submit", *argv, "Hello"]))

    assert tool_fields() == {}
    assert tool_fields("--tools", json.dumps(TOOLS)) == {"tools": TOOLS}
    for choice in ("auto", "none", "required"):
        assert tool_fields("--tool-choice", choice) == {"tool_choice": choice}
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_fields("--tool-choice", "get_weather") == {"tool_choice": named}
    assert tool_fields("--tool-choice", json.dumps(named)) == {"tool_choice": named}


def parse(*argv: str):
    return build_parser().parse_args(["generate", "--chat", *argv, "Hello"])


def test_constraint_flags_map_to_structured_outputs(tmp_path) -> None:
    (tmp_path / "g.ebnf").write_text('root ::= "yes" | "no"')
    assert constraint_kwargs(parse()) == {}
    assert constraint_kwargs(parse("--regex", "[0-9]+")) == {"structured_outputs": {"regex": "[0-9]+"}}
    assert constraint_kwargs(parse("--choice", "yes", "--choice", "no")) == {
        "structured_outputs": {"choice": ["yes", "no"]}
    }
    assert constraint_kwargs(parse("--grammar", f"@{tmp_path / 'g.ebnf'}")) == {
        "structured_outputs": {"grammar": 'root ::= "yes" | "no"'}
    }
    assert constraint_kwargs(parse("--grammar", "root ::= [a-z]+")) == {
        "structured_outputs": {"grammar": "root ::= [a-z]+"}
    }
    assert constraint_kwargs(parse("--json-object")) == {"structured_outputs": {"json_object": True}}
    assert constraint_kwargs(parse("--json-schema", '{"type": "integer"}')) == {
        "structured_outputs": {"json": {"type": "integer"}}
    }
    with pytest.raises(ValueError, match="--choice: structured_outputs.choice must be a non-empty list"):
        constraint_kwargs(parse("--choice", ""))


def test_chat_flags_map_to_chat_fields() -> None:
    assert chat_kwargs(parse()) == {}
    assert chat_kwargs(parse("--no-add-generation-prompt")) == {"add_generation_prompt": False}
    assert chat_kwargs(parse("--continue-final-message")) == {
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    args = parse("--chat-template", "{{ messages }}", "--chat-template-kwargs", '{"a": 1}', "--regex", "x")
    assert request_kwargs(args) == {
        "chat_template": "{{ messages }}",
        "chat_template_kwargs": {"a": 1},
        "structured_outputs": {"regex": "x"},
    }
    with pytest.raises(SystemExit):
        parse("--chat-template-kwargs", "[1]")
