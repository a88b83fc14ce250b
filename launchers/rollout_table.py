"""The rollout table: every ``trainer.rollout_table_every`` steps, rank 0 writes the samples of its
share of the step's batch (prompt, response, the episode's conversation, turns, tool calls and
errors, lengths, reward and each reward term) to ``<output_dir>/rollouts/step_<step>.jsonl``, and its first rows as a
markdown table to TensorBoard (``rollouts``, TEXT tab), as verl and NeMo-RL log sampled
generations."""

from __future__ import annotations

import json
from pathlib import Path

SHOWN = 4  # rows in TensorBoard


def rollout_rows(rollout, tokenizer) -> list[dict]:
    """One dict per sample of ``rollout`` (:class:`alignment.trainers.rl_phases.Rollout`); rewards and
    terms when they are one per sample (rft and online DPO keep a subset of what they scored)."""
    n = len(rollout.samples)
    rewards = rollout.rewards if len(rollout.rewards) == n else None
    terms = {k: v for k, v in rollout.reward_terms.items() if len(v) == n} if rewards is not None else {}
    rows = []
    for i, s in enumerate(rollout.samples):
        info = s.info or {}
        rows.append({
            "prompt": tokenizer.decode(s.prompt_ids),
            "response": tokenizer.decode(s.response_ids),
            "answer": s.text, "messages": info.get("messages"),
            "turns": info.get("turns", 1), "tool_calls": info.get("tool_calls", 0),
            "tool_errors": info.get("tool_errors", 0), "finished": s.finished,
            "response_tokens": len(s.response_ids), "generated_tokens": s.generated_tokens, "reward": None if rewards is None else float(rewards[i]),
            **{f"reward/{k}": float(v[i]) for k, v in terms.items()}})
    return rows


def _cell(text: str, limit: int = 300) -> str:
    text = text if len(text) <= limit else text[:limit] + " ..."
    return text.replace("|", "\\|").replace("\n", "<br>")


def write_rollout_table(out: Path, step: int, rollout, tokenizer, writer=None) -> Path:
    """Write step ``step``'s table (see the module docstring); returns the JSONL path."""
    rows = rollout_rows(rollout, tokenizer)
    path = Path(out) / "rollouts" / f"step_{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"step": step, **r}) + "\n" for r in rows))
    tmp.replace(path)
    if writer is not None and rows:
        lines = ["| reward | turns | tool calls | response |", "|---|---|---|---|"]
        lines += [f"| {'-' if r['reward'] is None else format(r['reward'], '.3f')} | {r['turns']} | {r['tool_calls']} | {_cell(r['response'])} |"
                  for r in rows[:SHOWN]]
        writer.add_text("rollouts", f"**prompt:** {_cell(rows[0]['prompt'], 600)}\n\n" + "\n".join(lines), step)
        writer.flush()
    return path
