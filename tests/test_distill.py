"""On-policy distillation's losses (alignment/algorithms/distill_loss.py): hand-computed values, TRL's
``GKDTrainer.generalized_jsd_loss`` on written cases (several beta and temperatures, masks with holes),
the whole-distribution log-softmax over a padded vocabulary, the per-micro-batch terms the GRPO step adds
(alignment/trainers/distill.py), and the checks before start (a teacher, its tokenizer)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from alignment.algorithms.distill_loss import generalized_jsd, jsd_beta, reverse_kl_advantages
from alignment.config import validate
from alignment.schema import ConfigError
from alignment.trainers.distill import distill_terms
from parallel.vocab_logprobs import vocab_parallel_log_softmax
from tests.dist.tiny_models import tiny_qwen3_moe_config
from tests.test_config import SMOLLM2, cfg


def test_kl_and_jsd_by_hand():
    # student (0.5, 0.5), teacher (0.9, 0.1)
    s = torch.log(torch.tensor([0.5, 0.5]))
    t = torch.log(torch.tensor([0.9, 0.1]))
    forward = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # KL(T || S) = 0.368064
    reverse = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # KL(S || T) = 0.510826
    assert generalized_jsd(s, t, 0.0).item() == pytest.approx(forward, abs=1e-6)
    assert generalized_jsd(s, t, 1.0).item() == pytest.approx(reverse, abs=1e-6)
    # beta = 0.5: the mixture (0.7, 0.3); the Jensen-Shannon divergence
    m = (0.7, 0.3)
    jsd = 0.5 * (0.9 * math.log(0.9 / m[0]) + 0.1 * math.log(0.1 / m[1])) + \
        0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))
    assert generalized_jsd(s, t, 0.5).item() == pytest.approx(jsd, abs=1e-6)
    # the limits of the mixture form are the two KLs: continuous at both ends
    assert generalized_jsd(s, t, 1e-6).item() == pytest.approx(0.0, abs=1e-5)  # beta KL(T||M) -> 0, KL(S||S) = 0
    assert generalized_jsd(s, s, 0.3).item() == pytest.approx(0.0, abs=1e-7)
    assert jsd_beta("forward_kl", 0.7) == 0.0 and jsd_beta("jsd", 0.7) == 0.7
    with pytest.raises(ValueError, match="beta=1.5: must be in"):
        generalized_jsd(s, t, 1.5)
    with pytest.raises(ValueError, match="distill_loss='reverse_kl': a whole-distribution loss"):
        jsd_beta("reverse_kl", 0.5)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_generalized_jsd_equals_trl_gkd(beta, temperature):
    """TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` (batchmean over the labels that are not -100)
    against megalign's: the log-softmax at the temperature (:func:`vocab_parallel_log_softmax`), the
    per-position divergence, and the token mean over the mask; values and student gradients."""
    from trl.experimental.gkd import GKDTrainer

    g = torch.Generator().manual_seed(int(beta * 10) + int(temperature * 100))
    b, seq, vocab = 3, 7, 11
    student = (3 * torch.randn(b, seq, vocab, generator=g, dtype=torch.float64)).requires_grad_(True)
    teacher = 3 * torch.randn(b, seq, vocab, generator=g, dtype=torch.float64)
    mask = torch.ones(b, seq)
    mask[0, :2] = 0  # a prompt
    mask[1, 3] = 0  # a hole: a tool's output inside a multi-turn episode
    mask[2, 5:] = 0  # padding
    labels = torch.where(mask.bool(), torch.ones(b, seq, dtype=torch.long), torch.full((b, seq), -100))
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=temperature)
    (their_grad,) = torch.autograd.grad(theirs, student)

    s_lp = vocab_parallel_log_softmax(student, vocab, temperature).double()
    t_lp = vocab_parallel_log_softmax(teacher, vocab, temperature).double()
    ours = (generalized_jsd(s_lp, t_lp, beta) * mask).sum() / mask.sum()
    (our_grad,) = torch.autograd.grad(ours, student)
    assert ours.item() > 1e-3  # the distributions differ
    # vocab_parallel_log_softmax computes in fp32 (as every megalign log-softmax)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    assert torch.allclose(our_grad, their_grad, rtol=1e-4, atol=1e-7)


def test_log_softmax_drops_padded_vocabulary_columns():
    logits = torch.randn(2, 3, 8)
    logits[..., 6:] = 50.0  # padding columns (vocab 6 padded to 8) would dominate if kept
    out = vocab_parallel_log_softmax(logits, 6, temperature=0.7)
    assert out.shape == (2, 3, 6) and out.dtype == torch.float32
    assert torch.allclose(out, torch.log_softmax(logits[..., :6] / 0.7, -1), atol=1e-6)
    with pytest.raises(ValueError, match="fewer than vocab_size=9"):
        vocab_parallel_log_softmax(logits, 9)
    with pytest.raises(ValueError, match="temperature=0"):
        vocab_parallel_log_softmax(logits, 6, temperature=0)


def test_reverse_kl_advantages_by_hand():
    teacher = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    student = torch.tensor([[-1.5, -1.0, -0.5, -9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    adv = reverse_kl_advantages(teacher, student, mask)
    # log pi_T - log pi_S on the response: the student over-weights token 1 (advantage -1), matches on 2
    assert adv.tolist() == [[0.0, -1.0, 0.0, 0.0]]


def test_distill_terms_of_a_micro_batch():
    """The GRPO step's distillation terms: reverse_kl adds the teacher-minus-student advantages to the task's
    (weighted) share; jsd adds the token-mean divergence (the global normaliser) and keeps the task's."""
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    old = torch.tensor([[-1.0, -1.0, -2.0, -1.0], [-1.0, -1.0, -0.5, -3.0]])
    teacher = torch.tensor([[-9.0, -0.5, -2.5, -9.0], [-9.0, -9.0, -1.5, -1.0]])
    mb = {"response_mask": mask, "advantages": torch.tensor([0.5, -1.0]), "teacher_logprobs": teacher,
          "input_ids": torch.zeros(2, 4, dtype=torch.long)}
    rk = SimpleNamespace(distill_loss="reverse_kl", distill_beta=0.5, loss_agg_mode="token-mean")
    adv, extra, m = distill_terms(mb, {}, old, 4.0, rk)
    assert extra is None
    assert adv.tolist() == [[0.0, 0.5 + 0.5, 0.5 - 0.5, 0.0], [0.0, 0.0, -1.0 - 1.0, -1.0 + 2.0]]
    # the sampled tokens' log pi_S - log pi_T: -0.5 + 0.5 + 1.0 - 2.0
    assert m["distill_kl_sum"].item() == pytest.approx(-1.0)

    vocab = 5
    g = torch.Generator().manual_seed(0)
    student = torch.log_softmax(torch.randn(2, 4, vocab, generator=g), -1).requires_grad_(True)
    teacher_full = torch.log_softmax(torch.randn(2, 4, vocab, generator=g), -1)
    ids = torch.tensor([[1, 2, 3, 4], [0, 1, 2, 3]])
    mb = {"response_mask": mask, "advantages": torch.tensor([0.5, -1.0]), "teacher_vocab_logprobs": teacher_full,
          "input_ids": ids}
    js = SimpleNamespace(distill_loss="jsd", distill_beta=0.25, loss_agg_mode="token-mean")
    adv, extra, m = distill_terms(mb, {"vocab_logprobs": student}, old, 8.0, js)
    assert adv.tolist() == [[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, -1.0, -1.0]]  # the task's share only
    div = generalized_jsd(student, teacher_full, 0.25)
    assert extra.item() == pytest.approx(((div * mask).sum() / 8.0).item())
    assert m["distill_divergence_sum"].item() == pytest.approx((div * mask).sum().item())
    # position t scores token t + 1: the teacher's log-probability of the next input id
    t_next = torch.tensor([[teacher_full[0, 1, 3], teacher_full[0, 2, 4]], [teacher_full[1, 2, 3], teacher_full[1, 3, 0]]])
    s_old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    assert m["distill_kl_sum"].item() == pytest.approx((s_old - t_next).sum().item(), abs=1e-6)
    extra.backward()
    assert student.grad[mask == 0].abs().max() == 0 and student.grad[mask == 1].abs().max() > 0


def test_distill_config_checks():
    teacher = "model.teacher_path=/teachers/grpo/hf"
    validate(cfg(name="distill"), world_size=2, hf_config=SMOLLM2)
    c = cfg(teacher, "algorithm.kl_coef=0", name="grpo")
    with pytest.raises(ConfigError, match=r"model.teacher_path=/teachers/grpo/hf is set, but algorithm.name=grpo has "
                                          r"no teacher; set algorithm.name=distill"):
        validate(c, world_size=2, hf_config=SMOLLM2)
    # distillation alone needs no group; the task's advantages do
    validate(cfg("rollout.group_size=1", "trainer.micro_batch_size=4", name="distill"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"rollout.group_size=1: the task's group-normalised advantages "
                                          r"\(algorithm.task_reward_weight=0.5\) need at least 2 samples per prompt"):
        validate(cfg("rollout.group_size=1", "trainer.micro_batch_size=4", "algorithm.task_reward_weight=0.5",
                     name="distill"), world_size=2,
                 hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"algorithm.distill_loss='kl': valid values are reverse_kl, jsd, forward_kl"):
        validate(cfg("algorithm.distill_loss=kl", name="distill"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"algorithm.name=distill needs a teacher: set model.teacher_path"):
        validate(cfg("model.teacher_path=''", name="distill"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"algorithm.distill_beta=1.5: must be in \[0, 1\]"):
        validate(cfg("algorithm.distill_beta=1.5", name="distill"), world_size=2, hf_config=SMOLLM2)
    # off-policy KD on the teacher's answers: a whole-distribution loss, no task gradient, its engine's layouts
    teacher = ("algorithm.distill_samples=teacher", "algorithm.distill_loss=forward_kl")
    validate(cfg(*teacher, name="distill"), world_size=2, hf_config=SMOLLM2)
    for overrides, message in [
        (("algorithm.distill_samples=teacher",), r"algorithm.distill_samples=teacher trains on the teacher's answers, "
                                                r"but algorithm.distill_loss=reverse_kl is an on-policy loss .* set "
                                                r"algorithm.distill_loss=forward_kl"),
        ((*teacher, "algorithm.task_reward_weight=0.5"), r"algorithm.task_reward_weight=0.5 would train the student by "
                                                         r"policy gradient on the teacher's answers"),
        (("algorithm.distill_samples=both",), r"algorithm.distill_samples='both': valid values are student, teacher, dataset"),
        ((*teacher, "parallel.pipeline_model_parallel_size=2"), r"algorithm.distill_samples=teacher generates with "
                                                                r"Megatron's engine .* but parallel.pipeline_model_"
                                                                r"parallel_size=2: set those"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(cfg(*overrides, name="distill"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"algorithm.routing_replay=r3 replays the student's own sampling routing, "
                                          r"but with algorithm.distill_samples=teacher the student does not sample"):
        validate(cfg(*teacher, "algorithm.routing_replay=r3", "rollout.backend=megatron", name="distill"), world_size=2,
                 hf_config=tiny_qwen3_moe_config())
    # off-policy KD on a dataset's answers: a file with a response column, one answer per prompt, one turn
    dataset = ("algorithm.distill_samples=dataset", "algorithm.distill_loss=jsd", "data.train_files=/data/kd.jsonl",
               "reward.functions=[{name: math_verify}]", "data.response_key=completion", "rollout.group_size=1",
               "trainer.micro_batch_size=4")
    validate(cfg(*dataset, name="distill"), world_size=2, hf_config=SMOLLM2)
    for overrides, message in [
        (dataset[:4], r"algorithm.distill_samples=dataset trains on each prompt's answer in a file: set "
                      r"data.train_files and data.response_key"),
        ((*dataset, "rollout.group_size=2"), r"algorithm.distill_samples=dataset takes each prompt's one answer from "
                                             r"the file, on the trainer ranks, but rollout.group_size=2: set "
                                             r"rollout.group_size=1"),
        ((*dataset, "rollout.placement=disaggregated", "rollout.rollout_ranks=1"),
         r"but rollout.placement=disaggregated: set rollout.group_size=1, max_turns=1, max_staleness=0, "
         r"placement=colocated"),
        ((*dataset, "algorithm.distill_loss=reverse_kl"), r"algorithm.distill_samples=dataset trains on the dataset's "
                                                          r"answers, but algorithm.distill_loss=reverse_kl is an "
                                                          r"on-policy loss"),
        ((*dataset, "algorithm.rollout_correction.is_level=token"),
         r"algorithm.rollout_correction weighs tokens by the student's own sampling policy, but with "
         r"algorithm.distill_samples=dataset the student did not sample them \(the dataset's answers\); set "
         r"algorithm.rollout_correction.is_level and mask_level to null"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(cfg(*overrides, name="distill"), world_size=2, hf_config=SMOLLM2)


def _word_tokenizer(path, words: list[str]):
    """A saved word-level tokenizer whose ids are ``words``' positions (the end-of-text token first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[1]))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=words[0], unk_token=words[1])
    tok.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def test_the_teacher_must_share_the_students_tokenizer(tmp_path):
    from launchers.input_checks import check_same_tokenizer

    words = ["<eos>", "<unk>", "one", "two", "three"]
    student = _word_tokenizer(tmp_path / "student", words)
    _word_tokenizer(tmp_path / "same", words)
    check_same_tokenizer(tmp_path / "same", student, "student/")  # the same ids: accepted
    _word_tokenizer(tmp_path / "swapped", ["<eos>", "<unk>", "two", "one", "three"])
    with pytest.raises(ConfigError, match=r"model.teacher_path=.*swapped: its tokenizer \(5 tokens\) differs from "
                                          r"the student's \(model.path=student/: .*student, 5 tokens\): token 'one' is "
                                          r"id 3 for the teacher, 2 for the student; distillation scores the student's "
                                          r"token ids"):
        check_same_tokenizer(tmp_path / "swapped", student, "student/")
    _word_tokenizer(tmp_path / "eos", ["<unk>", "<eos>", "one", "two", "three"])
    with pytest.raises(ConfigError, match=r"token '<eos>' is id 1 for the teacher, 0 for the student"):
        check_same_tokenizer(tmp_path / "eos", student, "student/")
