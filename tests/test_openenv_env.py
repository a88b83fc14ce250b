"""OpenEnv environments as the task (``rollout.environment=openenv``, ``alignment/rollout/agents/openenv_env.py``):
the number-guessing game of ``tests/openenv_envs.py`` served by uvicorn in a subprocess, its episodes played against
the rollout server on 127.0.0.1 in front of a scripted model: the reset observation is the prompt, each reply the
action, each observation the next user turn (loss mask 0), the step rewards summed; a crashed server drops its
episodes and the next ones get a new server; an unreachable URL and bad arguments named; the config checks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from alignment.rollout.agents.openenv_env import (HELDOUT_SEED, MAX_FAILED_STARTS, EnvServer, check_app, check_server,
                                                  episode_agent, openenv_problems, openenv_spec, reply_text)
from alignment.rollout.agents.programs import AgentError, episode_samples, play_episodes, task_row
from tests.scripted_engine import ScriptedEngine
from tests.test_agent_server import run_agents

GAME = {"app": "tests.openenv_envs:app", "train_size": 6, "heldout_size": 2}


def halving(prompt: str, k: int) -> str:
    """The scripted player: guesses 4, then 7 after "higher" or 1 after "lower", then 8 or 0; says "crash" when the
    game's first message asks it to in the system prompt."""
    if "Crash the game." in prompt:
        return "crash"
    said = re.findall(r"<\|im_start\|>user\n(higher|lower|Say one digit\.)<\|im_end\|>", prompt)
    if not said:
        return "My guess: 4"
    if len(said) == 1:
        return "7" if said[0] == "higher" else "1"
    return "8" if said[-1] == "higher" else "0"


def reward_of(secret: int) -> float:
    """What the halving player earns against the secret, by hand: 1 when one of its (at most three) guesses hits."""
    guesses = [4, 7 if secret > 4 else 1]
    guesses.append((8 if secret > guesses[1] else 0) if secret > 4 else (8 if secret > 1 else 0))
    return float(secret in guesses[:3])


@pytest.fixture
def game():
    spec = openenv_spec("tests.openenv_envs:GuessEnv", GAME)
    server = EnvServer(spec)
    yield spec, server
    server.close()


@pytest.fixture
def rollout_server(chatml_turns, smollm2_tokenizer):
    from alignment.rollout.agents.server import RolloutServer

    srv = RolloutServer(chatml_turns, ScriptedEngine(smollm2_tokenizer, halving).generate, max_tokens=200)
    srv.start()
    yield srv
    srv.close()


def play(srv, agent, problems, n=2):
    rows = [task_row(p) for p in problems]
    [groups] = run_agents(srv, [play_episodes(agent, rows, n, srv.session_url, srv.pop_session, 16, 60, "g",
                                              srv.playing)])
    return groups


@pytest.mark.slow  # serves the game with uvicorn in a subprocess
def test_an_episode_is_reset_then_a_step_per_reply(game, rollout_server, smollm2_tokenizer):
    spec, server = game
    sets = openenv_problems(spec)
    assert [p.columns["seed"] for p in sets.train] == list(range(6))
    assert [p.columns["seed"] for p in sets.heldout] == [HELDOUT_SEED, HELDOUT_SEED + 1]
    groups = play(rollout_server, episode_agent(spec, server), sets.train)
    for seed, group in enumerate(groups):
        for o in group:
            assert o.status == "ok" and o.reward == reward_of(seed % 10), (seed, o)
        s = episode_samples([group], 0)[0][0]
        text = smollm2_tokenizer.decode(s.prompt_ids + s.response_ids)
        assert "<|im_start|>user\nI am thinking of a digit from 0 to 9." in smollm2_tokenizer.decode(s.prompt_ids)
        turns = 1 if seed == 4 else 2 if (seed in (7, 1)) else 3
        assert s.info["turns"] == turns and text.count("<|im_start|>assistant\n") == turns
        said = re.findall(r"user\n(higher|lower)<", text)  # the game's answers: the environment's (loss mask 0)
        assert len(said) == turns - 1
        if said:
            game_text = smollm2_tokenizer.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0])
            model_text = smollm2_tokenizer.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 1])
            assert all(w in game_text for w in said) and "higher" not in model_text and "lower" not in model_text
    assert server.starts == 1


@pytest.mark.slow  # serves the game with uvicorn in a subprocess
def test_a_crashed_server_drops_its_episodes_and_the_next_ones_get_a_new_one(rollout_server):
    crash = openenv_spec("tests.openenv_envs:GuessEnv", {**GAME, "system_prompt": "Crash the game."})
    server = EnvServer(crash)
    try:
        groups = play(rollout_server, episode_agent(crash, server), openenv_problems(crash).train[:1])
        assert [o.status for o in groups[0]] == ["failed", "failed"]
        assert all(set(s.loss_mask) == {0} for s in episode_samples(groups, 0)[0])
        spec = openenv_spec("tests.openenv_envs:GuessEnv", GAME)
        server.spec = spec  # the same server object, now played fairly: it starts a new process
        groups = play(rollout_server, episode_agent(spec, server), openenv_problems(spec).train[4:5])
        assert [(o.status, o.reward) for o in groups[0]] == [("ok", 1.0), ("ok", 1.0)] and server.starts == 2
    finally:
        server.close()


@pytest.mark.slow  # serves the game with uvicorn in a subprocess
def test_bad_arguments_and_servers_are_named(tmp_path):
    for env_id, args, match in [
        ("tests.openenv_envs", GAME, r"needs rollout.environment_id=package.module:Client"),
        ("tests.openenv_envs:GuessAction", GAME, r"is not an openenv EnvClient subclass"),
        ("tests.no_such:Env", GAME, r"module 'tests.no_such' does not import"),
        ("tests.openenv_envs:GuessEnv", {**GAME, "port": 1}, r"environment_args has port, which an OpenEnv environment "
                                                             r"does not take; valid: url, app,"),
        ("tests.openenv_envs:GuessEnv", {}, r"give rollout.environment_args.url \(a running server\) or .app"),
        ("tests.openenv_envs:GuessEnv", {**GAME, "url": "http://x"}, r"one of them"),
        ("tests.openenv_envs:GuessEnv", {**GAME, "action_field": "guess"}, r"action_field=guess: GuessAction has no "
                                                                           r"such field"),
        ("tests.openenv_envs:GuessEnv", {**GAME, "max_turns": 0}, r"max_turns=0: must be an integer >= 1"),
    ]:
        with pytest.raises(AgentError, match=match):
            openenv_spec(env_id, args)
    with pytest.raises(AgentError, match=r"rollout.environment_args.url=http://127.0.0.1:9 does not answer"):
        check_server("http://127.0.0.1:9", timeout_s=2)
    broken = openenv_spec("tests.openenv_envs:GuessEnv", {**GAME, "app": "tests.openenv_envs:no_app"})
    server = EnvServer(broken, tmp_path / "logs" / "environment_rank0.log")  # its folder made when it starts
    for _ in range(MAX_FAILED_STARTS):  # the log's last line says why
        with pytest.raises(AgentError, match=r"app=tests.openenv_envs:no_app: its server exited with status 3: "
                                             r"ERROR: +Error loading ASGI app. Attribute \"no_app\" not found"):
            server.url_now()
    start = time.monotonic()
    with pytest.raises(AgentError, match=r"not found in module \"tests.openenv_envs\". \(its log: .*\) \(its last 3 "
                                         r"starts failed: not started again\)"):
        server.url_now()
    assert time.monotonic() - start < 0.5 and server.starts == MAX_FAILED_STARTS


@pytest.mark.slow  # serves the game with uvicorn in a subprocess, twice
def test_the_apps_server_ignores_slurms_preemption_notice_and_goes_with_its_parent(tmp_path):
    """``scancel --signal=USR1`` (the preemption notice the trainer checkpoints on) reaches every process of the
    step: the app's server ignores it. A rank killed with SIGKILL runs no exit handler: its server exits anyway."""
    spec = openenv_spec("tests.openenv_envs:GuessEnv", GAME)
    server = EnvServer(spec)
    try:
        url = server.url_now()
        os.kill(server.proc.pid, signal.SIGUSR1)
        time.sleep(0.5)
        assert server.proc.poll() is None
        check_server(url, timeout_s=5)
    finally:
        server.close()
    rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from alignment.rollout.agents.openenv_env import EnvServer, openenv_spec
        server = EnvServer(openenv_spec("tests.openenv_envs:GuessEnv", {"app": "tests.openenv_envs:app"}))
        server.url_now()
        print(server.proc.pid, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    child = int(rank.stdout.readline())
    rank.kill()
    rank.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (reaped by init soon) has exited
        return f.read().split(")")[-1].split()[0] != "Z"


def test_environment_arguments_are_checked_and_a_reply_is_the_action_as_written():
    for args, match in [
        ({**GAME, "reset_kwargs": {"seed": 3}}, r"reset_kwargs=\{'seed': 3\}: give a mapping of reset\(\)'s keyword "
                                                r"arguments, without seed"),
        ({**GAME, "reset_kwargs": [1]}, r"reset_kwargs=\[1\]: give a mapping"),
        ({**GAME, "timeout_s": 0}, r"timeout_s=0: must be a number of seconds > 0"),
        ({**GAME, "train_size": HELDOUT_SEED + 1}, rf"train_size={HELDOUT_SEED + 1}: at most {HELDOUT_SEED}"),
    ]:
        with pytest.raises(AgentError, match=match):
            openenv_spec("tests.openenv_envs:GuessEnv", args)
    check_app("tests.openenv_envs:app")
    for app, match in [("tests.openenv_envs", r"give package.module:app"),
                       ("tests.openenv_envs:no_app", r"module 'tests.openenv_envs' has no 'no_app'"),
                       ("tests.openenv_envs:GUESSES", r"is a int, not an ASGI app"),
                       ("tests.no_such:app", r"module 'tests.no_such' does not import")]:
        with pytest.raises(AgentError, match=r"rollout.environment_args.app=" + re.escape(app) + ".*" + match):
            check_app(app)
    from openai.types.chat import ChatCompletionMessage

    plain = ChatCompletionMessage(role="assistant", content="My guess: 4")
    called = ChatCompletionMessage.model_validate({"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c_0", "type": "function", "function": {"name": "peek", "arguments": '{"at": 2}'}}]})
    assert reply_text(plain) == "My guess: 4"
    assert reply_text(called) == 'Let me look.\n<tool_call>\n{"name": "peek", "arguments": {"at": 2}}\n</tool_call>'


def test_openenv_config_checks():
    from alignment.config import validate
    from alignment.rewards.policy import reward_terms
    from alignment.schema import ConfigError
    from tests.test_config import SMOLLM2, cfg

    hub = ("rollout.environment=openenv", "rollout.environment_id=tests.openenv_envs:GuessEnv")
    c = cfg(*hub, "rollout.environment_args={app: 'tests.openenv_envs:app'}")
    validate(c, world_size=2, hf_config=SMOLLM2)
    assert [t.name for t in reward_terms(c)] == ["environment"]
    with pytest.raises(ConfigError, match=r"rollout.environment=openenv needs rollout.environment_id"):
        validate(cfg("rollout.environment=openenv"), world_size=2, hf_config=SMOLLM2)
