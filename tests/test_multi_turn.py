"""Multi-turn episodes with hand-written scripted "models": the tokens between turns come from the
chat template (SmolLM2's ChatML), the model's tokens are kept exactly as generated (never
re-tokenised), the loss mask is 1 on them only, the engine's logprobs sit on them, and the episode
ends by the environment, by max_turns or by the token budget; the tool environment's turns (calls,
errors, several calls) and the padded batch built from episodes."""

from __future__ import annotations

import pytest
import torch

from alignment.data.tasks import Problem
from alignment.envs.base import SingleTurn, Transition
from alignment.envs.tool_env import ToolEnvironment, tools_system_prompt
from alignment.envs.tools import TOOLS
from alignment.data.samples import SamplingConfig
from alignment.rollout.episodes.multi_turn import run_episodes
from alignment.training.batching import make_batch
from tests.conftest import SMOLLM2_EOS
from tests.scripted_engine import ScriptedEngine

EOS = SMOLLM2_EOS  # <|im_end|>


@pytest.fixture
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture
def turns(chatml_turns):
    return chatml_turns


PROBLEM = Problem("Calculate 12 * 7 + 5.", "89", "arithmetic")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7 + 5"}}</tool_call>'


def test_turn_tokens_follow_the_chat_template(tokenizer, turns):
    assert turns.closing == "<|im_end|>\n"
    obs = [{"role": "tool", "content": "89"}]
    after_eos = turns.continuation_ids([5, EOS], obs)
    after_stop = turns.continuation_ids([5, 6], obs)  # stopped on "</tool_call>": the turn is closed here
    assert tokenizer.decode(after_eos) == "\n<|im_start|>tool\n89<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(after_stop) == "<|im_end|>\n<|im_start|>tool\n89<|im_end|>\n<|im_start|>assistant\n"
    assert after_stop[0] == EOS and after_stop[1:] == after_eos


def test_tool_episode_tokens_mask_and_logprobs(tokenizer, turns):
    def script(prompt: str, k: int) -> str:
        return "The answer is 89." if "<|im_start|>tool\n89" in prompt else "Let me compute. " + CALL

    engine = ScriptedEngine(tokenizer, script)
    env = ToolEnvironment()
    [[s]] = run_episodes(engine.generate, env, [PROBLEM], turns, SamplingConfig(n=1, max_tokens=400), max_turns=4)
    first, second = engine.char_ids("Let me compute. " + CALL), engine.char_ids("The answer is 89.") + [EOS]
    obs = turns.continuation_ids(first, [{"role": "tool", "content": "89"}])
    # token-in/token-out: the model's own ids, the template's ids for the tool turn, the model's again
    assert s.response_ids == first + obs + second
    assert s.loss_mask == [1] * len(first) + [0] * len(obs) + [1] * len(second)
    assert s.logprobs == [-0.01 * (i + 1) for i in range(len(first))] + [0.0] * len(obs) + [
        -0.01 * (i + 1) for i in range(len(second))]
    # the second turn continued from exactly prompt + first turn + observation
    (p1, c1), (p2, c2) = engine.calls
    assert p2 == [s.prompt_ids + first + obs] and c1.stop == ["</tool_call>"] and c2.n == 1
    assert c2.max_tokens == 400 - len(first) - len(obs)  # what is left of the response budget
    assert s.text == "The answer is 89." and s.finished
    assert s.info["turns"] == 2 and s.info["tool_calls"] == 1 and s.info["tool_errors"] == 0
    assert s.info["env_tokens"] == len(obs) and s.generated_tokens == len(first) + len(second)
    assert s.info["env_reward"] == 1.0  # the shaping reward of its first error-free call
    # the prompt: the tool list as the system message, then the question with the tool instruction
    text = tokenizer.decode(s.prompt_ids)
    assert text.startswith("<|im_start|>system\n" + tools_system_prompt([TOOLS["calculator"]]))
    assert "Calculate 12 * 7 + 5." in text and text.endswith("<|im_start|>assistant\n")
    assert [m["role"] for m in s.info["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    # the whole episode reads as the template renders its conversation (the model's text included),
    # up to the newline the template writes after the last EOS
    rendered = tokenizer.apply_chat_template(s.info["messages"], tokenize=False)
    assert tokenizer.decode(s.prompt_ids + s.response_ids) + "\n" == rendered


def test_episode_routing_keeps_each_turns_own(tokenizer, turns):
    """A MoE engine's routing (R3) across turns: every position keeps the routing of the turn that first
    routed it (the one that sampled its successors), the first turn's unrouted last token takes the
    second turn's, the episode's last token stays unknown; make_batch lays it out by position."""
    engine = ScriptedEngine(tokenizer, lambda prompt, k: "89" if "tool\n" in prompt.split("user")[-1] else CALL,
                            routing=True)
    [[s]] = run_episodes(engine.generate, ToolEnvironment(), [PROBLEM], turns, SamplingConfig(n=1, max_tokens=400),
                         max_turns=3)
    first = len(engine.char_ids(CALL))
    p, r = len(s.prompt_ids), len(s.response_ids)
    expected = torch.ones(p + r, 2, 1, dtype=torch.int16)
    expected[: p + first - 1] = 0
    expected[-1] = -1
    assert torch.equal(s.routed_experts, expected)
    batch = make_batch([s, s], pad_id=0)
    assert batch["routed_experts"].shape == (2, batch["input_ids"].shape[1], 2, 1)
    assert torch.equal(batch["routed_experts"][1, : p + r], expected) and (batch["routed_experts"][:, p + r:] == -1).all()


def test_episode_batch_masks_tool_tokens(tokenizer, turns):
    engine = ScriptedEngine(tokenizer, lambda prompt, k: "89" if "tool\n" in prompt.split("user")[-1] else CALL)
    groups = run_episodes(engine.generate, ToolEnvironment(), [PROBLEM], turns,
                          SamplingConfig(n=2, max_tokens=400), max_turns=3)
    samples = groups[0]
    assert len(samples) == 2 and len(engine.calls) == 2 and len(engine.calls[1][0]) == 2  # both continued
    batch = make_batch(samples, pad_id=0)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        mask = torch.tensor(s.loss_mask, dtype=torch.float32)
        assert torch.equal(batch["response_mask"][i, p - 1 : p + r - 1], mask)
        assert batch["response_mask"][i].sum() == s.generated_tokens < r
        assert torch.equal(batch["rollout_logprobs"][i, p - 1 : p + r - 1], torch.tensor(s.logprobs))
        assert batch["rollout_logprobs"][i][batch["response_mask"][i] == 0].abs().sum() == 0


def test_max_turns_and_budget_end_episodes(tokenizer, turns):
    engine = ScriptedEngine(tokenizer, lambda prompt, k: CALL)  # never answers
    [[s]] = run_episodes(engine.generate, ToolEnvironment(), [PROBLEM], turns,
                         SamplingConfig(n=1, max_tokens=1000), max_turns=3)
    assert s.info["turns"] == 3 and s.info["tool_calls"] == 3 and not s.finished  # out of turns, not done
    assert s.info["env_reward"] == 1.0  # three good calls, rewarded once
    assert len(engine.calls) == 3 and s.loss_mask.count(0) == 2 * len(turns.continuation_ids(
        engine.char_ids(CALL), [{"role": "tool", "content": "89"}]))
    call = len(engine.char_ids(CALL))
    budget = call + 10  # room for one call, not for the tool's answer and another token
    [[s]] = run_episodes(engine.generate, ToolEnvironment(), [PROBLEM], turns,
                         SamplingConfig(n=1, max_tokens=budget), max_turns=3)
    assert s.info["turns"] == 1 and len(s.response_ids) == call and not s.finished and s.loss_mask is None
    # a turn cut by the budget: the episode ends there, unfinished, within the budget
    budget = call + 30
    [[s]] = run_episodes(engine.generate, ToolEnvironment(), [PROBLEM], turns,
                         SamplingConfig(n=1, max_tokens=budget), max_turns=3)
    assert s.info["turns"] == 2 and len(s.response_ids) == budget and not s.finished


def test_malformed_and_several_calls_are_answered(tokenizer, turns):
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 +"}}</tool_call>'
    two = ('<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 3"}}</tool_call>'
           '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    env = ToolEnvironment()
    moves = env.step([PROBLEM] * 4, [[]] * 4, [bad, two, "<tool_call>{oops</tool_call>", "42"])
    assert moves[0].info == {"tool_calls": 1, "tool_errors": 1} and moves[0].observation[0]["content"].startswith(
        "Error:")
    assert [m["content"] for m in moves[1].observation][0] == "6" and moves[1].info == {"tool_calls": 2,
                                                                                        "tool_errors": 1}
    assert "unknown tool 'nope'" in moves[1].observation[1]["content"]
    assert "not valid JSON" in moves[2].observation[0]["content"] and moves[2].info["tool_errors"] == 1
    assert moves[3].done and not moves[3].observation
    assert [m.reward for m in moves] == [0.0, 0.0, 0.0, 0.0]  # no error-free call among them
    assert "Error: tool call 1: not valid JSON" in moves[2].observation[0]["content"]
    with pytest.raises(ValueError, match="rollout.tools"):
        ToolEnvironment(tools=["search"])


def test_single_turn_environment_is_one_generate_call(tokenizer, turns):
    engine = ScriptedEngine(tokenizer, lambda prompt, k: f"answer {k}")
    from alignment.data.prompts import build_prompt_ids

    sampling = SamplingConfig(n=3, max_tokens=20)
    groups = run_episodes(engine.generate, SingleTurn(), [PROBLEM, PROBLEM], turns, sampling, max_turns=1)
    direct = ScriptedEngine(tokenizer, lambda prompt, k: f"answer {k}").generate(
        [build_prompt_ids(tokenizer, PROBLEM)] * 2, sampling)
    assert len(engine.calls) == 1 and engine.calls[0][1] == sampling  # the same request as without episodes
    for got, want in zip(sum(groups, []), sum(direct, [])):
        assert (got.prompt_ids, got.response_ids, got.logprobs, got.text, got.finished, got.loss_mask) == (
            want.prompt_ids, want.response_ids, want.logprobs, want.text, want.finished, None)


def test_single_turn_answers_are_handed_out_as_generated(tokenizer, turns):
    """``on_done`` sees each problem's answers once, the episodes' own texts; multi-turn episodes,
    whose last answer comes at the end, never call it."""
    engine = ScriptedEngine(tokenizer, lambda prompt, k: f"answer {k}")
    seen = []
    groups = run_episodes(engine.generate, SingleTurn(), [PROBLEM, PROBLEM], turns, SamplingConfig(n=2, max_tokens=20),
                          max_turns=1, on_done=lambda i, samples: seen.append((i, [s.text for s in samples])))
    assert seen == [(0, ["answer 0", "answer 1"]), (1, ["answer 0", "answer 1"])]
    assert [[s.text for s in g] for g in groups] == [texts for _, texts in seen]
    seen.clear()
    run_episodes(ScriptedEngine(tokenizer, lambda prompt, k: "no call").generate, ToolEnvironment(), [PROBLEM], turns,
                 SamplingConfig(n=1, max_tokens=40), max_turns=3, on_done=lambda i, samples: seen.append(i))
    assert seen == []


def test_turns_are_taken_together_across_ranks(tokenizer, turns):
    """A rank whose episodes are over keeps calling generate (with nothing) while another rank's go on."""
    engine = ScriptedEngine(tokenizer, lambda prompt, k: "done")
    others_live = iter([True, True, False])

    class Env(SingleTurn):
        def step(self, problems, messages, replies):
            return [Transition(done=True, reward=0.5) for _ in replies]

    [[s]] = run_episodes(engine.generate, Env(), [PROBLEM], turns, SamplingConfig(n=1, max_tokens=8),
                         max_turns=4, keep_going=lambda live: live or next(others_live))
    assert [len(p) for p, _ in engine.calls] == [1, 0, 0] and s.info["env_reward"] == 0.5
    with pytest.raises(ValueError, match="max_turns"):
        run_episodes(engine.generate, Env(), [PROBLEM], turns, SamplingConfig(), max_turns=0)


def test_turn_cap_closes_the_turn_and_the_environment_answers(tokenizer, turns):
    engine = ScriptedEngine(tokenizer, lambda prompt, k: "a long ramble that never ends")

    class Echo(SingleTurn):
        def step(self, problems, messages, replies):
            return [Transition([{"role": "user", "content": "go on"}], reward=1.0) for _ in replies]

    [[s]] = run_episodes(engine.generate, Echo(), [PROBLEM], turns, SamplingConfig(n=1, max_tokens=60),
                         max_turns=3, max_tokens_per_turn=5)
    assert [c.max_tokens for _, c in engine.calls] == [5, 5, 5] and s.info["turns"] == 3 and not s.finished
    cut = engine.char_ids("a lon")
    obs = turns.continuation_ids(cut, [{"role": "user", "content": "go on"}])
    assert tokenizer.decode(obs) == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    assert s.response_ids == cut + obs + cut + obs + cut and s.info["env_reward"] == 3.0
    with pytest.raises(ValueError, match="max_tokens_per_turn"):
        run_episodes(engine.generate, Echo(), [PROBLEM], turns, SamplingConfig(), 2, max_tokens_per_turn=0)


def test_episode_prompts_carry_their_images_across_turns(tokenizer, turns):
    """A problem's images become its prompt's (an ``ImagePrompt``, placeholders expanded by the model's
    processor), every later turn's prompt keeps them, and so does the episode's sample (the trainer's batch
    takes them); a problem without images stays plain token ids."""
    from alignment.data.images import ImageInputs
    from alignment.rollout.engines.image_prompts import ImagePrompt

    image = ImageInputs(torch.arange(24.0).view(6, 4), torch.tensor([[1, 2, 3]]))

    class Processor:  # ImageProcessor's interface: every image 3 placeholder tokens at the prompt's end
        def encode_files(self, files, where):
            return [image if fs else None for fs in files]

        def expand(self, ids, inputs, where):
            return ids + [7] * 3

    seen = []
    engine = ScriptedEngine(tokenizer, lambda prompt, k: "The answer is 89." if "<|im_start|>tool\n89" in prompt
                            else "Let me compute. " + CALL)

    def generate(prompts, sampling, on_done=None):
        seen.append(list(prompts))
        return engine.generate(prompts, sampling, on_done)

    shown = Problem(PROBLEM.question, PROBLEM.answer, PROBLEM.task, images=("shapes.png",))
    [[s], [plain]] = run_episodes(generate, ToolEnvironment(), [shown, PROBLEM], turns,
                                  SamplingConfig(n=1, max_tokens=400), max_turns=4, images=Processor())
    first, second = seen[0], seen[1]
    assert isinstance(first[0], ImagePrompt) and first[0].images is image and first[0][-3:] == [7, 7, 7]
    assert not isinstance(first[1], ImagePrompt) and list(first[0][:-3]) == first[1]
    assert isinstance(second[0], ImagePrompt) and second[0].images is image and second[0][:len(first[0])] == first[0]
    assert s.images is image and plain.images is None
    batch = make_batch([s, plain], pad_id=0)
    assert batch["image_counts"].tolist() == [1, 0] and torch.equal(batch["pixel_values"], image.pixel_values)
