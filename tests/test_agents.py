"""Agent programs as rollouts (``alignment/rollout/agents/programs.py``) against the rollout server on 127.0.0.1 and a
scripted engine: a hanging agent and a crashing agent dropped and counted, their groups masked out of the
loss; an external command's environment, reward and failures; the task row; the config checks."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import textwrap
import time

import openai  # imported before the timed episodes
import pytest

from alignment.data.tasks import Problem
from alignment.rollout.agents.programs import (AgentError, EpisodeLoop, command_agent, episode_samples, load_agent,
                                               play_episodes, task_row)
from tests.scripted_engine import ScriptedEngine
from tests.test_agent_server import run_agents

ROWS = [{"question": "Say hi.", "n": 0}, {"question": "Say bye.", "n": 1}]


async def chatty(base_url: str, row: dict):
    """Asks once, returns the reply's length as the reward; row n=1's second episode hangs, n=2's crashes."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["question"]}])
    episode = base_url.rstrip("/").split("/")[-2]
    if row["n"] == 1 and episode.endswith("-1"):
        await asyncio.sleep(60)
    if row["n"] == 2:
        raise RuntimeError("the agent's own bug")
    return float(len(reply.choices[0].message.content))


@pytest.fixture
def server(chatml_turns, smollm2_tokenizer):
    from alignment.rollout.agents.server import RolloutServer

    srv = RolloutServer(chatml_turns, ScriptedEngine(smollm2_tokenizer, lambda prompt, k: "hello").generate,
                        max_tokens=64)
    srv.start()
    yield srv
    srv.close()


def test_hanging_and_crashing_agents_are_dropped_and_counted(server):
    rows = ROWS + [{"question": "Crash.", "n": 2}]
    deltas = []  # what the server is told about the episodes being played
    [groups] = run_agents(server, [play_episodes(chatty, rows, 2, server.session_url, server.pop_session,
                                                 concurrency=4, timeout_s=5.0, prefix="t", playing=deltas.append)])
    assert len(deltas) == 12 and max(itertools.accumulate(deltas)) == 4 and sum(deltas) == 0  # the hung one too
    assert [[o.status for o in g] for g in groups] == [["ok", "ok"], ["ok", "timeout"], ["failed", "failed"]]
    assert groups[0][0].reward == 5.0 and groups[1][1].reward is None
    assert groups[1][1].error == "episode t-1-1: past rollout.agent_timeout_s=5.0"
    assert groups[2][0].error == "episode t-2-0: RuntimeError: the agent's own bug"
    assert server.sessions == {}  # every session was collected, the failed ones too
    samples = episode_samples(groups, filler_id=0)
    ok = samples[0]
    assert [s.info["env_reward"] for s in ok] == [5.0, 5.0] and all(s.loss_mask is None for s in ok)
    assert ok[0].text == "hello" and ok[0].info["turns"] == 1
    # a group with a failed episode: nothing of it is trained on (its recorded episode neither)
    for g in samples[1:]:
        assert all(s.loss_mask == [0] * len(s.response_ids) for s in g)
    hung = samples[1][1]
    assert hung.response_ids == [0] and hung.prompt_ids == samples[1][0].prompt_ids  # its prompt was recorded
    assert [s.info["agent_status"] for g in samples for s in g] == ["ok", "ok", "ok", "timeout", "failed", "failed"]
    assert samples[1][1].info["env_reward"] != samples[1][1].info["env_reward"]  # NaN: unscored


def test_an_agent_command_gets_its_episode_in_its_environment(server, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        from openai import OpenAI
        task = json.loads(os.environ["MEGALIGN_TASK"])
        if task["n"] == 1:
            sys.exit("no luck: " + task["question"])
        client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["question"]}])
        print("log line")
        print(json.dumps({"reward": 0.25, "episode": os.environ["MEGALIGN_EPISODE"],
                          "text": reply.choices[0].message.content}))
    """))
    agent = command_agent(f"{sys.executable} {script}")
    [groups] = run_agents(server, [play_episodes(agent, ROWS, 1, server.session_url, server.pop_session, 2, 60.0,
                                                 "cmd")])
    [[ok], [bad]] = groups
    assert ok.status == "ok" and ok.reward == 0.25 and ok.session.text == "hello"
    assert ok.session.episode_id == "cmd-0-0"
    assert bad.status == "failed" and "exited with status 1: no luck: Say bye." in bad.error


def test_a_timed_out_command_is_killed(server, tmp_path):
    marker = tmp_path / "still_running"
    agent = command_agent(f"sleep 2; touch {marker}")
    [groups] = run_agents(server, [play_episodes(agent, ROWS[:1], 1, server.session_url, server.pop_session, 1, 0.5,
                                                 "slow")])
    assert groups[0][0].status == "timeout"
    import time

    time.sleep(2.5)
    assert not marker.exists()  # the program went with its episode


def test_loading_an_agent_names_what_is_wrong():
    assert load_agent("tests.test_agents:chatty") is chatty
    for path, match in [("tests.test_agents", r"give package.module:function"),
                        ("tests.no_such_module:run", r"module 'tests.no_such_module' does not import"),
                        ("tests.test_agents:missing", r"module 'tests.test_agents' has no 'missing'"),
                        ("tests.test_agents:task_row", r"is not an async function")]:
        with pytest.raises(AgentError, match=match):
            load_agent(path)


def test_the_task_row_holds_the_record():
    row = task_row(Problem("Q?", "4", "file", messages=({"role": "user", "content": "Q?"},), columns={"level": 2}))
    assert row == {"question": "Q?", "answer": "4", "task": "file", "level": 2,
                   "messages": [{"role": "user", "content": "Q?"}]}
    assert json.loads(json.dumps(row)) == row


def test_agent_config_checks():
    from alignment.config import validate
    from alignment.schema import ConfigError
    from tests.test_config import SMOLLM2, cfg

    agent = "rollout.agent=tests.agent_examples:three_turns"
    validate(cfg(agent), world_size=2, hf_config=SMOLLM2)
    validate(cfg("rollout.agent_command='python my_agent.py'"), world_size=2, hf_config=SMOLLM2)
    for overrides, match in [
        ((agent, "rollout.agent_command=x"), r"rollout.agent=tests.agent_examples:three_turns and "
                                             r"rollout.agent_command are both set: give one"),
        (("rollout.agent=tests.agent_examples:missing",), r"module 'tests.agent_examples' has no 'missing'"),
        ((agent, "rollout.environment=tools", "rollout.max_turns=4"), r"is the episode's environment \(it runs the "
                                                                      r"tools\); rollout.environment=tools would be a "
                                                                      r"second one"),
        ((agent, "rollout.max_staleness=1", "algorithm.rollout_correction.is_level=token"),
         r"max_staleness=1 are not supported with it yet: set placement=colocated, max_staleness=0"),
        ((agent, "rollout.agent_timeout_s=0"), r"rollout.agent_timeout_s=0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            validate(cfg(*overrides), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"plays GRPO-family episodes \(and PPO's on data.task\); "
                                          r"algorithm.name=online_dpo samples otherwise"):
        validate(cfg(agent, name="online_dpo"), world_size=2, hf_config=SMOLLM2)


def test_the_react_math_example_runs_its_calculator_against_the_server(chatml_turns, smollm2_tokenizer):
    from alignment.rollout.agents.server import RolloutServer
    from examples.agents import react_math
    from tests.test_agent_session import PROBLEM, script

    assert (react_math.calculate("(12 + 3) * 4"), react_math.calculate("7 / 2"), react_math.calculate("-2*-3")) == (
        "60", "3.5", "6")
    assert react_math.calculate("__import__('os')").startswith("Error: ")
    assert react_math.calculate("1/0") == "Error: division by zero"
    rewards, sessions = {}, {}
    for name, model in (("m", script), ("no_call", lambda prompt, k: "It is 89."),
                        ("bad_call", lambda prompt, k: "The answer is 89." if "<|im_start|>tool" in prompt else
                         '<tool_call>{"name": "calculator", "arguments": {"expression": "89 apples"}}</tool_call>'),
                        ("wrong_tool", lambda prompt, k: "The answer is 89." if "<|im_start|>tool" in prompt else
                         '<tool_call>{"name": "search", "arguments": {"query": "89"}}</tool_call>')):
        srv = RolloutServer(chatml_turns, ScriptedEngine(smollm2_tokenizer, model).generate, max_tokens=400)
        srv.start()
        try:
            [rewards[name]] = run_agents(srv, [react_math.run(srv.session_url(name), {"question": PROBLEM.question})])
        finally:
            srv.close()
        sessions[name] = srv.pop_session(name)
    # the shaping reward: a call that returned a value; none, or only calls the calculator refused: 0
    assert rewards == {"m": 1.0, "no_call": 0.0, "bad_call": 0.0, "wrong_tool": 0.0}
    assert [m["content"] for m in sessions["wrong_tool"].messages if m["role"] == "tool"] == [
        "Error: no tool named 'search'"]
    s = sessions["m"]
    assert s.turn_count == 3 and s.text == "The answer is 89."
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in s.messages if m["role"] == "tool"] == ["84", "89"]
    prompt = smollm2_tokenizer.decode(s.prompt_ids)
    assert react_math.SYSTEM in prompt and react_math.INSTRUCTION in prompt and '"calculator"' in prompt  # the tools too


def test_the_humaneval_example_tests_its_code_in_the_sandbox(chatml_turns, smollm2_tokenizer):
    """A scripted model that runs a test program through the python tool, reads its output and submits."""
    from alignment.rollout.agents.server import RolloutServer
    from examples.agents import humaneval_coder

    code = "def add(a, b):\n    return a + b\nprint(add(2, 3))"
    call = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"

    def model(prompt: str, k: int) -> str:
        return "```python\ndef add(a, b):\n    return a + b\n```" if "<|im_start|>tool\n5\n" in prompt else call

    srv = RolloutServer(chatml_turns, ScriptedEngine(smollm2_tokenizer, model).generate, max_tokens=400)
    srv.start()
    try:
        [reward] = run_agents(srv, [humaneval_coder.run(srv.session_url("h"), {"question": "def add(a, b):"})])
    finally:
        srv.close()
    s = srv.pop_session("h")
    assert reward == 1.0 and s.turn_count == 2 and s.text.startswith("```python\ndef add")
    assert [m["content"] for m in s.messages if m["role"] == "tool"] == ["5\n"]  # what the sandboxed program printed
    assert humaneval_coder.ran("5\n") and humaneval_coder.ran("(no output: print the result)")
    assert not humaneval_coder.ran("1\nError: NameError: name 'x' is not defined")


def test_the_react_math_example_runs_as_a_command(chatml_turns, smollm2_tokenizer):
    from alignment.rollout.agents.server import RolloutServer
    from tests.test_agent_session import PROBLEM, script

    srv = RolloutServer(chatml_turns, ScriptedEngine(smollm2_tokenizer, script).generate, max_tokens=400)
    srv.start()
    try:
        agent = command_agent(f"{sys.executable} -m examples.agents.react_math")
        [groups] = run_agents(srv, [play_episodes(agent, [{"question": PROBLEM.question}], 1, srv.session_url,
                                                  srv.pop_session, 1, 60.0, "cmd")])
    finally:
        srv.close()
    [[outcome]] = groups
    assert outcome.status == "ok", outcome.error
    assert outcome.reward == 1.0 and outcome.session.turn_count == 3 and outcome.session.text == "The answer is 89."


def test_an_episode_that_stops_the_event_loop_fails_the_phase_instead_of_hanging_it():
    """asyncio lets ``SystemExit`` and ``KeyboardInterrupt`` out of its loop, which kills the loop's thread: the
    phase's future would never be done and the serving thread would wait forever. :meth:`EpisodeLoop.run` sees the
    thread die and raises, naming the error, and so does every later phase; a phase before it ran as usual."""
    served = []

    def serve(until):
        start = time.monotonic()
        while not until():
            assert time.monotonic() - start < 10, "the serving thread hangs"
            time.sleep(0.005)
        served.append(True)

    async def fine():
        await asyncio.sleep(0.01)
        return 7

    for error, named in ((SystemExit(3), r"SystemExit\(3\)"), (KeyboardInterrupt(), r"KeyboardInterrupt\(\)")):
        async def stops(error: BaseException = error):
            await asyncio.sleep(0.01)
            raise error

        loop = EpisodeLoop()
        assert loop.run(fine(), serve) == 7
        with pytest.raises(RuntimeError, match=r"the episodes' event loop stopped: an episode raised " + named +
                           r", which asyncio does not contain"):
            loop.run(stops(), serve)
        assert not loop.thread.is_alive()
        with pytest.raises(RuntimeError, match=r"the episodes' event loop stopped earlier"):
            loop.run(fine(), serve)
    assert len(served) == 4  # the phases before and during the stop: served until done
