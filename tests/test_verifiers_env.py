"""verifiers environments as the task (``rollout.environment=verifiers``, ``alignment/rollout/agents/verifiers_env.py``),
against the rollout server on 127.0.0.1 in front of a scripted engine: a ``SingleTurnEnv``'s rewards are its
rubric's two weighted functions (and a group-level one) computed by hand from the recorded tokens' text; a
``ToolEnv``'s tool turn is recorded as the multi-turn path records one (the tool's output masked out of the
loss); the environment's datasets become the prompts; a failing group is dropped whole; the config checks."""

from __future__ import annotations

import asyncio
import itertools
import signal

import pytest

from alignment.rollout.agents.programs import AgentError, EpisodeLoop, episode_samples, play_groups, task_row
from alignment.rollout.agents.verifiers_env import describe, environment_problems, group_agent, load_environment
from tests.scripted_engine import ScriptedEngine
from tests.test_agent_server import run_agents

GROUP = 4


CALLS = itertools.count()


def replies(prompt: str, k: int) -> str:
    """The scripted model: the right sum for even questions, a wrong one for odd, with 0 to 2 "!" by the order the
    requests come in (so a group's replies differ, some alike); in the tool environment a call of ``add`` first,
    then the tool's result as the answer."""
    if "<|im_start|>tool\n" in prompt:
        return f"It is {prompt.split('<|im_start|>tool' + chr(10))[-1].split('<|im_end|>')[0]}."
    if "What is " not in prompt:
        return "ok"
    question = prompt.split("What is ")[-1].split("?")[0]
    a, b = (int(x) for x in question.split(" + "))
    if "add tool" in prompt:
        return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    return f"{a + b if a % 2 == 0 else a + b + 1}" + "!" * (next(CALLS) % 3)


@pytest.fixture
def server(chatml_turns, smollm2_tokenizer):
    from alignment.rollout.agents.server import RolloutServer

    engine = ScriptedEngine(smollm2_tokenizer, replies)
    srv = RolloutServer(chatml_turns, engine.generate, max_tokens=200)
    srv.start()
    srv.engine = engine
    yield srv
    srv.close()


def play(srv, env, problems, n=GROUP):
    """Each problem's group of ``n`` episodes played by ``env``'s group agent (given its dataset's rows, as
    :func:`alignment.trainers.agent_rollout.agent_episodes` gives them); returns the outcomes."""
    rows = [dict(p.columns) for p in problems]
    [groups] = run_agents(srv, [play_groups(group_agent(env), rows, n, srv.session_url, srv.pop_session,
                                            concurrency=64, timeout_s=60, prefix="t", playing=srv.playing)])
    return groups


def test_a_single_turn_environments_rewards_are_its_rubric_over_the_recorded_tokens(server, smollm2_tokenizer):
    env = load_environment("tests.verifiers_envs", {"group": True})
    sets = environment_problems(env, "tests.verifiers_envs")
    problems = list(sets.train[:3])
    groups = play(server, env, problems)
    samples = episode_samples(groups, 0)
    for p, group in zip(problems, samples):
        texts = [smollm2_tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in group]
        assert [s.text for s in group] == texts  # the rubric scored the text of the recorded tokens
        for s, text in zip(group, texts):
            want = float(p.answer in text) + 0.5 * float(len(text) % 2 == 0) + 0.25 * float(texts.count(text) == 1)
            assert s.info["env_reward"] == want and s.info["agent_status"] == "ok"
            assert s.loss_mask is None and s.logprobs == [-0.01 * (i + 1) for i in range(len(s.response_ids))]
            # the prompt the server rendered is the environment's own messages, system prompt first
            assert smollm2_tokenizer.decode(s.prompt_ids).startswith("<|im_start|>system\nAnswer with the number.")
    assert any(float(p.answer in s.text) for p, g in zip(problems, samples) for s in g)
    assert not all(float(p.answer in s.text) for p, g in zip(problems, samples) for s in g)
    distinct = [[s.text for s in g].count(s.text) == 1 for g in samples for s in g]
    assert any(distinct) and not all(distinct)  # the group-level function scored 0.25 for some, 0 for others


def test_a_tool_environments_episode_calls_its_tool_through_the_server(server, smollm2_tokenizer):
    env = load_environment("tests.verifiers_envs", {"kind": "tools"})
    [problem] = environment_problems(env, "tests.verifiers_envs").train[:1]
    [group] = episode_samples(play(server, env, [problem], n=2), 0)
    a, b = (int(x) for x in problem.question.split("What is ")[1].rstrip("?").split(" + "))
    for s in group:
        text = smollm2_tokenizer.decode(s.prompt_ids + s.response_ids)
        assert '"name": "add"' in smollm2_tokenizer.decode(s.prompt_ids)  # the tool's schema, rendered
        assert f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>' in text
        assert f"<|im_start|>tool\n{a + b}<|im_end|>" in text and s.text == f"It is {a + b}."
        assert s.info["turns"] == 2 and s.info["tool_calls"] == 1 and s.info["env_reward"] == 1.0
        # the tool's output and the template's text around it are the environment's: loss mask 0
        env_ids = [t for t, m in zip(s.response_ids, s.loss_mask) if m == 0]
        assert str(a + b) in smollm2_tokenizer.decode(env_ids) and s.loss_mask.count(0) == s.info["env_tokens"] > 0


def test_the_environments_datasets_are_the_prompts():
    env = load_environment("tests.verifiers_envs", {"num_train": 5, "num_eval": 2})
    sets = environment_problems(env, "tests.verifiers_envs")
    assert (len(sets.train), len(sets.heldout), sets.sources) == (5, 2, ("rollout.environment_id=tests.verifiers_envs",))
    p = sets.train[0]
    assert p.messages == ({"role": "system", "content": "Answer with the number."},
                          {"role": "user", "content": "What is 1 + 1?"})
    assert (p.question, p.answer, p.task) == ("What is 1 + 1?", "2", "file")
    assert set(p.columns) == {"question", "answer", "example_id", "prompt"}
    assert p.columns == dict(env.get_dataset()[0])  # what the group agent hands back to the environment
    assert describe(env) == "SingleTurnEnv, at most 1 turn(s); rubric: exact x 1, even_length x 0.5"
    assert describe(load_environment("tests.verifiers_envs", {"group": True, "num_train": 5})).endswith(
        "distinct x 0.25 (group)")
    import verifiers as vf

    own = vf.SingleTurnEnv(dataset=env.get_dataset(), sampling_args={"temperature": 0.3})
    assert describe(own).endswith("rubric: no function; its sampling_args {'temperature': 0.3} are replaced by "
                                  "rollout.temperature / top_p / agent_max_tokens_per_turn")
    without = environment_problems(load_environment("tests.verifiers_envs", {"num_eval": 0}), "x")
    assert len(without.heldout) == 0
    # trained in a seeded order from the first epoch (an environment's dataset may be sorted), unlike a built-in
    # task's first epoch, which is a seeded random draw already
    from alignment.data.config import DataConfig
    from alignment.data.prompt_data import training_order

    order = training_order(DataConfig(), 0, sets)
    assert sorted(order.permutation(0)) == list(range(5)) and list(order.permutation(0)) != list(range(5))
    assert list(training_order(DataConfig(), 0, type(sets)(sets.train, [], sources=("data.task=arithmetic",)))
                .permutation(0)) == list(range(5))


def test_a_failing_group_is_dropped_whole(server):
    async def half(urls, row):  # plays one episode of the two, then fails
        from openai import AsyncOpenAI

        await AsyncOpenAI(base_url=urls[0], api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 1 + 1?"}])
        if row["n"] == 1:
            raise RuntimeError("the environment's own bug")
        return [1.0, None] if row["n"] == 2 else [1.0]

    rows = [{"n": 1}, {"n": 2}, {"n": 3}]
    [groups] = run_agents(server, [play_groups(half, rows, 2, server.session_url, server.pop_session, 8, 60, "f")])
    assert [[o.status for o in g] for g in groups] == [["failed"] * 2] * 3
    assert "RuntimeError: the environment's own bug" in groups[0][0].error
    assert "never called the model" in groups[1][0].error  # episode 2 of the group was never played
    assert "not 2 rewards" in groups[2][0].error
    samples = episode_samples(groups, 0)
    assert all(set(s.loss_mask) == {0} for g in samples for s in g)
    assert server.sessions == {}  # every session of a failed group was taken off the server


def test_loading_an_environment_names_what_is_wrong():
    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    env = load_environment("tests.verifiers_envs", {"num_train": 3})
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == before  # verifiers' own taken off
    assert load_environment("tests.verifiers_envs", {"num_train": 3}) is env  # once per process
    for env_id, args, match in [
        (None, {}, r"needs rollout.environment_id"),
        ("tests.no_such_env", {}, r"rollout.environment_id=tests.no_such_env: Could not import 'tests.no_such_env' "
                                  r"\(ModuleNotFoundError: No module named 'tests.no_such_env'\)"),
        ("tests.verifiers_envs", {"kind": "chess"}, r"rollout.environment_id=tests.verifiers_envs: load_environment\("
                                                   r"\*\*rollout.environment_args=\{'kind': 'chess'\}\) failed: "
                                                   r"ValueError: kind='chess': single_turn, tools, multi_turn, raw, broken or judged"),
        ("tests.verifiers_envs", {"colour": 1}, r"TypeError: load_environment\(\) got an unexpected keyword"),
        ("tests.agent_examples", {}, r"does not expose load_environment"),
    ]:
        with pytest.raises(AgentError, match=match):
            load_environment(env_id, args)


def test_verifiers_config_checks():
    from alignment.config import validate
    from alignment.rewards.policy import heldout_grader, reward_terms
    from alignment.schema import ConfigError
    from tests.test_config import SMOLLM2, cfg

    hub = ("rollout.environment=verifiers", "rollout.environment_id=tests.verifiers_envs")
    c = cfg(*hub)
    validate(c, world_size=2, hf_config=SMOLLM2)
    assert [t.name for t in reward_terms(c)] == ["environment"] and heldout_grader(c).name == "environment"
    validate(cfg(*hub, "reward.functions=[{name: environment}, {name: length, weight: 0.1}]"), world_size=2,
             hf_config=SMOLLM2)
    for overrides, match in [
        (hub[:1], r"rollout.environment=verifiers needs rollout.environment_id"),
        (("rollout.environment_id=tests.verifiers_envs",), r"rollout.environment_id / environment_args name an "
                                                           r"environment hub's environment, but rollout.environment="
                                                           r"single_turn"),
        ((*hub, "reward.functions=[{name: length}]"), r"reward.functions has no environment term to train on it: "
                                                      r"add \{name: environment\}"),
        ((*hub, "rollout.agent=tests.agent_examples:three_turns"), r"rollout.agent / agent_command would be a second "
                                                                   r"player: unset it"),
        ((*hub, "rollout.max_staleness=1", "algorithm.rollout_correction.is_level=token"),
         r"rollout.environment=verifiers serves the agents from the trainers' engines"),
    ]:
        with pytest.raises(ConfigError, match=match):
            validate(cfg(*overrides), world_size=2, hf_config=SMOLLM2)


def test_what_a_verifiers_job_does_not_read_is_refused():
    from alignment.compose import compose
    from alignment.schema import ConfigError

    hub = ["rollout.environment=verifiers", "rollout.environment_id=tests.verifiers_envs"]
    c = compose("grpo", [*hub, "rollout.agent_max_tokens=64"])
    assert c.run_name == "grpo_verifiers_envs" and c.rollout.max_tokens == 64
    for key, why in [("data.task=gsm8k", r"data.task=gsm8k is set, .*without data.train_files or an environment hub: "
                                         r"it would change nothing"),
                     ("data.train_files=x.jsonl", r"data.train_files=x.jsonl is set, .*without an environment hub "
                                                  r"\(rollout.environment=verifiers / openenv: its tasks are the prompts\)"),
                     ("data.system_prompt=hi", r"data.system_prompt=hi is set, .*an environment's prompts are its own"),
                     ("rollout.max_turns=3", r"rollout.max_turns=3 is set, .*an environment hub's has its own")]:
        with pytest.raises(ConfigError, match=why):
            compose("grpo", [*hub, key])
    with pytest.raises(ConfigError, match=r"rollout.environment_args is set, .*with rollout.environment=verifiers or "
                                          r"openenv"):
        compose("grpo", ["rollout.environment_args={kind: tools}"])


def test_a_job_reads_the_environments_prompts_before_start(smollm2_tokenizer):
    from launchers.input_checks import check_data
    from alignment.compose import compose
    from alignment.config import job_config, validate
    from alignment.schema import ConfigError
    from tests.test_config import SMOLLM2

    def checked(*overrides):
        c = job_config(compose("grpo", list(overrides)))
        validate(c, world_size=2, hf_config=SMOLLM2)
        return check_data(c, smollm2_tokenizer)

    hub = ["rollout.environment=verifiers", "rollout.environment_id=tests.verifiers_envs",
           "rollout.environment_args={num_train: 6, num_eval: 3}", "rollout.agent_max_tokens=64"]
    prompts = checked(*hub)
    assert (len(prompts.train), len(prompts.heldout)) == (6, 3) and prompts.tokens > 0 and prompts.fingerprint
    with pytest.raises(ConfigError, match=r"rollout.environment_id=tests.no_such_env: Could not import"):
        checked(*hub[:1], "rollout.environment_id=tests.no_such_env")
    with pytest.raises(ConfigError, match=r"rollout.environment_id=tests.verifiers_envs: the longest prompt has \d+ "
                                          r"tokens"):
        checked(*hub, "rollout.max_model_len=70")


@pytest.mark.parametrize("reply", ["abcdefghijklmnopqrstuvwxyz", ""])
def test_an_episode_past_its_budget_ends_and_an_empty_answer_is_an_answer(chatml_turns, smollm2_tokenizer, reply):
    """A multi-turn environment's third request past the episode's 48 tokens gets the server's empty ``length``
    reply, which verifiers reads as a context-length error: the episode ends truncated, trained on. A model that
    answers nothing (EOS at once) gave an answer: scored by the rubric, not a failed rollout."""
    from alignment.rollout.agents.server import RolloutServer

    srv = RolloutServer(chatml_turns, ScriptedEngine(smollm2_tokenizer, lambda prompt, k: reply).generate,
                        max_tokens=48, max_tokens_per_turn=16)
    srv.start()
    try:
        env = load_environment("tests.verifiers_envs", {"kind": "multi_turn", "max_turns": 3})
        [group] = episode_samples(play(srv, env, environment_problems(env, "x").train[:1], n=2), 0)
    finally:
        srv.close()
    for s in group:
        assert s.info["agent_status"] == "ok" and set(s.loss_mask) == {0, 1}
        if reply:  # two turns of 16 tokens and a user turn between them fill the budget: the third is refused
            assert s.info["turns"] == 2 and len(s.response_ids) <= 48 and not s.finished
            assert s.info["env_reward"] == 0.5 * (len(s.text) % 2 == 0)
        else:  # three empty answers (EOS each) and two user turns
            assert s.info["turns"] == 3 and s.text == "" and s.info["env_reward"] == 0.5  # even_length of ""


def test_the_reasoning_gym_example_scores_with_reasoning_gyms_own_grader():
    """examples/environments/reasoning_gym_env.py: disjoint training and eval questions of the main job's task, the
    instruction of the built-in task, and a rubric that is reasoning-gym's score_answer of the reply's last number."""
    from examples.environments.reasoning_gym_env import INSTRUCTION, last_number
    from examples.environments.reasoning_gym_env import load_environment as example

    env = example(num_train=40, num_eval=10)
    train, held = env.get_dataset(), env.build_eval_dataset()
    assert (len(train), len(held)) == (40, 10)
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    row = train[0]
    assert row["question"].endswith("\n" + INSTRUCTION) and row["prompt"] == [{"role": "user", "content": row["question"]}]
    [correct] = [f for r in env.rubric.rubrics for f in r.funcs if f.__name__ == "correct"]  # beside the monitors
    right, wrong = [{"role": "assistant", "content": f"So it is {a}."} for a in (row["answer"], int(row["answer"]) + 1)]
    assert correct([right], row["info"]) == 1.0 and correct([wrong], row["info"]) == 0.0
    assert (last_number("2 + 3 = 5."), last_number(r"\boxed{-12}, not 4"), last_number("1,234"), last_number("no")) == (
        "5", "-12", "1234", None)


def test_the_environment_gets_its_own_rows_back_and_a_failed_rollout_drops_its_group(server):
    """A dataset of prompt and info only: each rollout's input is exactly the environment's row (nothing added, as
    verifiers passes every column to the rubric); an environment whose turn raises fails its whole group."""
    env = load_environment("tests.verifiers_envs", {"kind": "raw", "num_train": 2})
    rows = [dict(r) for r in env.get_dataset()]
    groups = play(server, env, environment_problems(env, "x").train, n=2)
    assert [[o.status for o in g] for g in groups] == [["ok", "ok"]] * 2
    assert sorted(env.seen, key=lambda r: r["example_id"]) == [rows[0], rows[0], rows[1], rows[1]]
    assert set(rows[0]) == {"prompt", "info", "example_id"}
    broken = load_environment("tests.verifiers_envs", {"kind": "broken", "num_train": 2})
    [group] = play(server, broken, environment_problems(broken, "x").train[:1], n=2)
    assert [o.status for o in group] == ["failed", "failed"]
    assert "the environment's rollout ended with Error: the environment's own failure" in group[0].error
    assert server.sessions == {}


def test_episodes_of_every_rollout_phase_run_on_one_event_loop(server):
    """An environment built once holds an AsyncOpenAI client (a judge's, as JudgeRubric's): its episodes must run
    on one event loop phase after phase (:class:`EpisodeLoop`), or its rubric fails from the second phase on and
    scores 0 in silence, as a fresh loop per phase shows (the control, asyncio.run's way)."""
    def phase(env, run) -> list[float]:
        rows = [dict(p.columns) for p in environment_problems(env, "x").train]
        groups = run(play_groups(group_agent(env), rows, 2, server.session_url, server.pop_session, 8, 60,
                                 f"p{next(CALLS)}", server.playing))
        return [o.reward for g in groups for o in g]

    def judged(name):
        return load_environment("tests.verifiers_envs", {"kind": "judged", "num_train": 2,
                                                         "judge_url": server.session_url(name)})

    control = judged("judge-a")
    fresh = [phase(control, lambda c: run_agents(server, [c])[0]) for _ in range(2)]
    assert fresh == [[1.0] * 4, [0.0] * 4]  # the judge's client is bound to the first phase's closed loop
    env, loop = judged("judge-b"), EpisodeLoop()
    assert [phase(env, lambda c: loop.run(c, lambda until: server.serve(until=until))) for _ in range(3)] == \
        [[1.0] * 4] * 3
