"""The rollout server (``alignment/rollout/agents/server.py``) on a real HTTP server on 127.0.0.1, driven by
the ``openai`` client as any agent would drive it, in front of a scripted engine: a 3-turn tool episode
recorded token for token as the multi-turn engine path records it; sixteen concurrent sessions, each
with its own record, batched into few engine calls; requests sent while the engine is away (a weight
sync) wait and are answered by the new weights; a rewritten history and bad settings refused."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from alignment.envs.tool_env import ToolEnvironment
from alignment.rollout.agents.server import EPISODE_HEADER, RolloutServer
from alignment.data.samples import SamplingConfig
from alignment.rollout.episodes.multi_turn import run_episodes
from tests.scripted_engine import ScriptedEngine
from tests.test_agent_session import PROBLEM, script

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluates arithmetic.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}}}}]


@pytest.fixture
def server(chatml_turns):
    servers = []

    def make(engine, **kw):
        s = RolloutServer(chatml_turns, engine.generate, max_tokens=400, **kw)
        s.start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def run_agents(server: RolloutServer, agents) -> list:
    """Run the coroutines ``agents`` in a thread of their own while this thread serves the engine; returns
    their results (or raises the first error)."""
    results, done = [None], threading.Event()

    def main():
        async def all_of():
            return await asyncio.gather(*agents, return_exceptions=True)
        try:
            results[0] = asyncio.run(all_of())
        finally:
            done.set()

    thread = threading.Thread(target=main)
    thread.start()
    server.serve(until=done.is_set)
    thread.join()
    for r in results[0]:
        if isinstance(r, BaseException):
            raise r
    return results[0]


async def calculator_agent(base_url: str, messages: list[dict], tools=None) -> str:
    """A ReAct loop written against the openai client only: call the model, run its tool calls, repeat."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(messages)
    while True:
        reply = await client.chat.completions.create(model="megalign-policy", messages=messages, tools=tools)
        message = reply.choices[0].message
        messages.append(message.model_dump())
        if reply.choices[0].finish_reason != "tool_calls":
            return message.content
        for call in message.tool_calls:
            result = str(eval(json.loads(call.function.arguments)["expression"]))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


def test_an_openai_client_agents_episode_is_recorded_as_the_engine_path_records_it(server, smollm2_tokenizer,
                                                                                   chatml_turns):
    env = ToolEnvironment()
    [[want]] = run_episodes(ScriptedEngine(smollm2_tokenizer, script).generate, env, [PROBLEM], chatml_turns,
                            SamplingConfig(n=1, max_tokens=400), max_turns=4)
    srv = server(ScriptedEngine(smollm2_tokenizer, script))
    [answer] = run_agents(srv, [calculator_agent(srv.session_url("ep-0"), env.reset([PROBLEM])[0])])
    assert answer == "The answer is 89."
    got = srv.pop_session("ep-0").sample()
    assert (got.prompt_ids, got.response_ids, got.logprobs, got.loss_mask, got.finished) == (
        want.prompt_ids, want.response_ids, want.logprobs, want.loss_mask, want.finished)
    assert got.info["turns"] == 3 and got.info["tool_calls"] == 2 and srv.pop_session("ep-0") is None


def test_sixteen_concurrent_sessions_each_keep_their_own_record(server, smollm2_tokenizer):
    """Each agent asks about its own number; every session's record holds its own prompt and answers, and
    the engine saw the sessions' turns in batches: one call per turn for all sixteen, as the server waits
    until each episode being played has its request queued (here with no other limit on the wait)."""
    def echo(prompt: str, k: int) -> str:
        asked = prompt.split("Double ")[-1].split("?")[0]
        if "<|im_start|>tool\n" in prompt:
            return f"It is {prompt.split('<|im_start|>tool' + chr(10))[-1].split('<|im_end|>')[0]}."
        return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "2 * {asked}"}}}}</tool_call>'

    engine = ScriptedEngine(smollm2_tokenizer, echo)
    srv = server(engine, batch_window_s=60.0, batch_max_wait_s=60.0)
    srv.playing(16)  # what the agent runner counts
    asks = [[{"role": "user", "content": f"Double {n}?"}] for n in range(100, 116)]
    answers = run_agents(srv, [calculator_agent(srv.session_url(f"s{n}"), m, TOOLS) for n, m in enumerate(asks)])
    assert answers == [f"It is {2 * n}." for n in range(100, 116)]
    for n in range(16):
        s = srv.pop_session(f"s{n}").sample()
        text = smollm2_tokenizer.decode(s.prompt_ids + s.response_ids)
        assert f"Double {100 + n}?" in text and f"2 * {100 + n}" in text and f"It is {2 * (100 + n)}." in text
        assert s.info["turns"] == 2 and s.loss_mask.count(0) == s.info["env_tokens"] > 0
        assert "calculator" in smollm2_tokenizer.decode(s.prompt_ids)  # the request's tools, rendered
    assert srv.requests == 32 and [len(prompts) for prompts, _ in engine.calls] == [16, 16]


def test_requests_wait_while_the_engine_syncs_weights_and_none_fails(server, smollm2_tokenizer):
    """Requests sent while nobody serves (the trainer's phases and the weight sync) queue up; once the
    new weights are in, the same requests are answered by them."""
    version = {"v": 1}
    engine = ScriptedEngine(smollm2_tokenizer, lambda prompt, k: f"weights v{version['v']}")
    srv = server(engine)
    results = []

    def agent(n):
        from openai import OpenAI

        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0,
                        default_headers={EPISODE_HEADER: f"w{n}"})
        results.append(client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"hi {n}"}],
                                                      timeout=60).choices[0].message.content)

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while srv.requests < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the engine is away: nothing is answered
    assert srv.requests == 4 and results == [] and engine.calls == []
    version["v"] = 2  # the weight sync
    srv.serve(until=lambda: all(not t.is_alive() for t in threads))
    assert results == ["weights v2"] * 4 and len(engine.calls) == 1


def test_bad_requests_are_refused_with_the_reason(server, smollm2_tokenizer):
    import openai

    srv = server(ScriptedEngine(smollm2_tokenizer, script))

    async def agent():
        client = openai.AsyncOpenAI(base_url=srv.session_url("bad"), api_key="unused", max_retries=0)
        first = [{"role": "user", "content": PROBLEM.question}]
        reply = await client.chat.completions.create(model="m", messages=first, tools=TOOLS)
        message = reply.choices[0].message.model_dump()
        errors = []
        for messages, extra in [(first + [{**message, "content": "I changed my mind."}, {"role": "user", "content": "?"}], {}),
                                (first + [message, {"role": "user", "content": "?"}], {"n": 2}),
                                (first + [message, {"role": "user", "content": "?"}], {"temperature": -1})]:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="m", messages=messages, **extra)
            errors.append(e.value.body["message"])
        ok = await client.chat.completions.create(model="m", messages=first + [message, {"role": "tool", "content": "84",
                                                                                         "tool_call_id": "x"}])
        return errors, ok.choices[0].finish_reason

    [(errors, finish)] = run_agents(srv, [agent()])
    assert errors[0].startswith("episode bad: message 1 (assistant) differs from the one this session holds")
    assert errors[1].startswith("n=2: the rollout server records one answer per request")
    assert errors[2].startswith("temperature=-1.0")
    assert finish == "tool_calls"  # the refused requests changed nothing: the episode went on
    s = srv.pop_session("bad")
    assert s.turn_count == 2 and [m["role"] for m in s.messages] == ["user", "assistant", "tool", "assistant"]


def test_completions_take_token_ids_and_refuse_a_drifted_prompt(server, smollm2_tokenizer):
    import httpx

    srv = server(ScriptedEngine(smollm2_tokenizer, lambda prompt, k: "ab"))
    url = srv.session_url("c") + "/completions"
    prompt = smollm2_tokenizer.encode("Say ab:", add_special_tokens=False)
    out = {}

    async def agent():
        async with httpx.AsyncClient(timeout=30) as client:
            first = (await client.post(url, json={"prompt": prompt, "max_tokens": 8})).json()
            session = srv.sessions["c"]
            ids = session.prompt_ids + session.ids
            second = (await client.post(url, json={"prompt": ids + [13], "max_tokens": 8})).json()
            wrong = await client.post(url, json={"prompt": [7] + ids[1:] + [13], "max_tokens": 8})
            out.update(first=first, second=second, wrong=(wrong.status_code, wrong.json()))

    run_agents(srv, [agent()])
    assert out["first"]["choices"][0]["text"] == "ab" and out["second"]["choices"][0]["finish_reason"] == "stop"
    status, body = out["wrong"]
    assert status == 400 and "the prompt differs from the episode's tokens at token 0" in body["error"]["message"]
    s = srv.pop_session("c").sample()
    assert s.prompt_ids == prompt and s.loss_mask.count(0) == 1 and s.info["turns"] == 2


def test_an_engine_without_stop_strings_refuses_them(server, smollm2_tokenizer):
    """Megatron's engine ends turns at EOS only: no tool stop is added, and a request's own is refused."""
    import openai

    engine = ScriptedEngine(smollm2_tokenizer, lambda prompt, k: "done")
    srv = server(engine, tool_stop=(), stop_strings=False)

    async def agent():
        client = openai.AsyncOpenAI(base_url=srv.session_url("m"), api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stop=["\n"])
        reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return e.value.body["message"], reply.choices[0].message.content

    [(error, text)] = run_agents(srv, [agent()])
    assert error.startswith("stop=['\\n']: this job's engine (rollout.backend=megatron) ends turns at EOS only")
    assert text == "done" and engine.calls[0][1].stop is None


def test_a_reply_is_cut_at_the_turn_cap_and_the_budget(server, smollm2_tokenizer):
    """A reply stops at ``max_tokens_per_turn``; new messages that leave no room in the episode's budget
    end the episode: an empty reply (finish_reason ``length``), no engine call, nothing recorded."""
    engine = ScriptedEngine(smollm2_tokenizer, lambda prompt, k: "abcdefghij")  # 10 characters + EOS
    srv = server(engine, max_tokens_per_turn=4)
    srv.max_tokens = 12  # the budget of each episode from now

    async def agent():
        import openai

        client = openai.AsyncOpenAI(base_url=srv.session_url("cap"), api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "go"}]
        capped = await client.chat.completions.create(model="m", messages=messages)
        messages += [capped.choices[0].message.model_dump(), {"role": "user", "content": "one two three four five"}]
        spent = await client.chat.completions.create(model="m", messages=messages)
        return capped.choices[0], spent.choices[0]

    [(choice, spent)] = run_agents(srv, [agent()])
    assert choice.finish_reason == "length" and choice.message.content == "abcd"
    assert (spent.finish_reason, spent.message.content, spent.message.tool_calls) == ("length", "", None)
    assert len(engine.calls) == 1 and engine.calls[0][1].max_tokens == 4
    s = srv.pop_session("cap").sample()
    assert len(s.response_ids) == 4 and s.loss_mask is None and s.text == "abcd"  # the user turn was not recorded


def test_a_prompt_past_the_context_is_refused_before_the_engine(server, smollm2_tokenizer):
    """An agent's (or an OpenEnv environment's) first message is known only when its episode starts: one whose
    prompt and budget (400 tokens) pass ``rollout.max_model_len`` is refused, naming both, instead of reaching
    the engine, which would fail the batch and the job; an episode that fits goes on."""
    import openai

    engine = ScriptedEngine(smollm2_tokenizer, lambda prompt, k: "fine")
    srv = server(engine, max_model_len=500)

    async def agent(words: int):
        client = openai.AsyncOpenAI(base_url=srv.session_url(f"e{words}"), api_key="unused", max_retries=0)
        try:
            reply = await client.chat.completions.create(model="m", messages=[{"role": "user",
                                                                               "content": " hello" * words}])
            return reply.choices[0].message.content
        except openai.BadRequestError as e:
            return e.body["message"]

    short, long = run_agents(srv, [agent(1), agent(200)])
    n = len(srv.pop_session("e200").prompt_ids)
    assert short == "fine" and n + 400 > 500 >= len(srv.pop_session("e1").prompt_ids) + 400
    assert long == (f"episode e200: its prompt is {n} tokens, which with the episode's budget of 400 "
                    "(rollout.max_tokens) passes rollout.max_model_len=500; raise rollout.max_model_len or shorten "
                    "the prompt")
    assert [len(p) + 400 <= 500 for prompts, _ in engine.calls for p in prompts] == [True]  # the long one: never sent
