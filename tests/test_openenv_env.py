"""OpenEnv environments as the task (``rollout.environment=openenv``, ``alignment/rollout/agents/openenv_env.py``):
the number-guessing game of ``tests/openenv_envs.py`` served by uvicorn in a subprocess, its episodes played against
the rollout server on 127.0.0.1 in front of a scripted model: the reset observation is the prompt, each reply the
action, each observation the next user turn (loss mask 0), the step rewards summed; a crashed server drops its
episodes and the next ones get a new server; an unreachable URL and bad arguments named; the config checks."""

from __future__ import annotations

import re

import pytest

from alignment.rollout.agents.openenv_env import (HELDOUT_SEED, EnvServer, check_server, episode_agent,
                                                  openenv_problems, openenv_spec)
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
def test_bad_arguments_and_servers_are_named():
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
    with pytest.raises(AgentError, match=r"app=tests.openenv_envs:no_app: its server exited with status"):
        EnvServer(broken).url_now()


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
