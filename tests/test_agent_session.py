"""The rollout server's session record (token-in/token-out, ``alignment/rollout/agents/session.py``): an
agent that sends its whole history each request gets exactly the tokens of the multi-turn engine path;
the replies carry the model's tool calls parsed; a rewritten history is refused."""

from __future__ import annotations

import json

import pytest

from alignment.data.tasks import Problem
from alignment.envs.tool_env import ToolEnvironment, tools_system_prompt
from alignment.rollout.agents.session import (AgentSession, EpisodeTooLong, HistoryRewritten, assistant_message,
                                             same_message)
from alignment.data.samples import SamplingConfig
from alignment.rollout.episodes.multi_turn import run_episodes
from tests.scripted_engine import ScriptedEngine

PROBLEM = Problem("Calculate 12 * 7 + 5.", "89", "arithmetic")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>'
CALL2 = '<tool_call>{"name": "calculator", "arguments": {"expression": "84 + 5"}}</tool_call>'


def script(prompt: str, k: int) -> str:
    """Three model turns: a call, another call after the first result, the answer after the second."""
    if "<|im_start|>tool\n89" in prompt:
        return "The answer is 89."
    return "Next. " + CALL2 if "<|im_start|>tool\n84" in prompt else "Let me compute. " + CALL


def test_a_three_turn_agent_episode_has_the_engine_paths_tokens(smollm2_tokenizer, chatml_turns):
    """The agent's side (the OpenAI message list, the assistant turns echoed back as the server returned
    them, ``tool_call_id`` on the results) gives the tokens, logprobs and loss mask of run_episodes' episode
    with the tool environment, token for token."""
    tokenizer, turns = smollm2_tokenizer, chatml_turns
    sampling = SamplingConfig(n=1, max_tokens=400, stop=["</tool_call>"])
    env = ToolEnvironment()
    [[want]] = run_episodes(ScriptedEngine(tokenizer, script).generate, env, [PROBLEM], turns,
                            SamplingConfig(n=1, max_tokens=400), max_turns=4)
    engine, session = ScriptedEngine(tokenizer, script), AgentSession(turns, "ep0", max_tokens=400)
    messages = list(env.reset([PROBLEM])[0])  # the agent's opening messages
    replies = []
    while True:
        ids = session.request_ids(messages)
        [[turn]] = engine.generate([ids], sampling)
        message, finish = session.record_turn(turn)
        replies.append((message, finish))
        echoed = json.loads(json.dumps({**message, "refusal": None, "audio": None}))  # as the openai client sends it
        messages.append(echoed)
        if finish != "tool_calls":
            break
        for call in message["tool_calls"]:  # the agent runs its tool
            expression = json.loads(call["function"]["arguments"])["expression"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(eval(expression))})
    got = session.sample()
    assert (got.prompt_ids, got.response_ids, got.logprobs, got.loss_mask, got.text, got.finished) == (
        want.prompt_ids, want.response_ids, want.logprobs, want.loss_mask, want.text, want.finished)
    assert got.info["turns"] == want.info["turns"] == 3 and got.info["tool_calls"] == want.info["tool_calls"] == 2
    assert got.info["env_tokens"] == want.info["env_tokens"] > 0
    # the replies: calls parsed out of the text, with ids the tool results refer to
    (first, f1), (second, f2), (last, f3) = replies
    assert (f1, f2, f3) == ("tool_calls", "tool_calls", "stop")
    assert first["content"] == "Let me compute." and first["tool_calls"] == [
        {"id": "call_ep0_1_0", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "12 * 7"}'}}]
    assert second["tool_calls"][0]["id"] == "call_ep0_2_0" and last == {"role": "assistant",
                                                                         "content": "The answer is 89."}


def test_a_rewritten_history_is_refused(smollm2_tokenizer, chatml_turns):
    engine = ScriptedEngine(smollm2_tokenizer, script)
    session = AgentSession(chatml_turns, "ep1", max_tokens=400)
    messages = [{"role": "user", "content": PROBLEM.question}]
    [[turn]] = engine.generate([session.request_ids(messages)], SamplingConfig(n=1, max_tokens=400,
                                                                               stop=["</tool_call>"]))
    message, _ = session.record_turn(turn)
    tool = {"role": "tool", "tool_call_id": "call_ep1_1_0", "content": "84"}
    edited = {**message, "tool_calls": [{**message["tool_calls"][0], "function": {
        "name": "calculator", "arguments": '{"expression": "12 * 8"}'}}]}
    for history, match in [
        ([{"role": "user", "content": "Calculate 12 * 8 + 5."}, message, tool], r"episode ep1: message 0 \(user\) "
                                                                                r"differs from the one this session holds"),
        ([messages[0], edited, tool], r"message 1 \(assistant\) differs"),
        ([messages[0], {**message, "content": "Let me think."}, tool], r"message 1 \(assistant\) differs"),
        ([messages[0], message], r"the request has 2 messages, the session 2; append the new ones"),
        ([messages[0], message, {"role": "assistant", "content": "89"}], r"may add tool and user messages, not "
                                                                         r"assistant turns"),
    ]:
        with pytest.raises(HistoryRewritten, match=match):
            session.request_ids(history)
    # the same history, keys the openai client adds, the arguments re-serialised: accepted
    spaced = {**message, "refusal": None, "tool_calls": [{**message["tool_calls"][0], "function": {
        "name": "calculator", "arguments": '{"expression":"12 * 7"}'}}]}
    ids = session.request_ids([messages[0], spaced, tool])
    assert ids[: len(session.prompt_ids)] == session.prompt_ids and session.mask[-1] == 0


def test_the_budget_and_the_first_request(smollm2_tokenizer, chatml_turns):
    session = AgentSession(chatml_turns, "ep2", max_tokens=30)
    with pytest.raises(HistoryRewritten, match="a request without messages"):
        session.request_ids([])
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluates arithmetic.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    ids = session.request_ids([{"role": "user", "content": "Hi"}], tools=tools)
    # SmolLM2's template ignores tools=: the list goes in as the tool environment writes it
    assert not chatml_turns.renders_tools()
    assert ids == chatml_turns.prompt_ids([{"role": "system", "content": tools_system_prompt(tools)},
                                           {"role": "user", "content": "Hi"}])
    assert "megalign" not in smollm2_tokenizer.decode(ids) and '"name": "calculator"' in smollm2_tokenizer.decode(ids)
    engine = ScriptedEngine(smollm2_tokenizer, lambda prompt, k: "Let me compute. " + CALL)
    [[turn]] = engine.generate([ids], SamplingConfig(n=1, max_tokens=30, stop=["</tool_call>"]))
    message, _ = session.record_turn(turn)
    assert session.budget == 30 - len(turn.response_ids)
    with pytest.raises(EpisodeTooLong, match=r"episode ep2: \d+ tokens of new messages leave no room in the "
                                             r"episode's 30 tokens"):
        session.request_ids([{"role": "user", "content": "Hi"}, message,
                             {"role": "tool", "tool_call_id": "call_ep2_1_0", "content": "84 " * 20}])


def test_replies_and_message_matching():
    message, finish = assistant_message("Sure. " + CALL + " and " + CALL2, "call_x")
    assert finish == "tool_calls" and message["content"] == "Sure.  and" and [
        json.loads(c["function"]["arguments"])["expression"] for c in message["tool_calls"]] == ["12 * 7", "84 + 5"]
    broken = "<tool_call>{not json}</tool_call> " + CALL
    message, finish = assistant_message(broken, "call_y")  # a malformed block keeps the text as written
    assert finish == "tool_calls" and message["content"] == broken and len(message["tool_calls"]) == 1
    assert assistant_message("<tool_call>{oops", "c") == ({"role": "assistant", "content": "<tool_call>{oops"}, "")
    parts = {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
    assert same_message(parts, {"role": "user", "content": "Hi there"})
    assert same_message({"role": "assistant", "content": None, "tool_calls": []}, {"role": "assistant", "content": ""})
    assert not same_message({"role": "tool", "tool_call_id": "a", "content": "1"},
                            {"role": "tool", "tool_call_id": "b", "content": "1"})
