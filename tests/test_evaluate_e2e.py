"""``tools/evaluate.py`` end to end with vLLM on tiny random models: an HF directory, the same weights
as a Megatron checkpoint saved at TP=2 inside a training run's directory, and other weights; the
results cache; the regression gate's exit status; vLLM at TP=2."""

from __future__ import annotations

import pytest

import json
import shutil

from tests.conftest import run_torchrun

COMMON = ["--suites", "arithmetic,regression", "--limit", "3", "--samples", "2", "--dtype", "float32",
          "--max-model-len", "512", "--kv-cache-gib", "0.25"]


def _regression_file(path, answers: list[str]) -> str:
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": q, "answer": a, "match": "contains"}) + "\n"
                            for i, (q, a) in enumerate(zip(["Say hi.", "Count to three.", "Name a fruit."], answers))))
    return str(path)


@pytest.mark.heavy(cheap="tests/test_evaluation.py::test_compare_finds_regressions_and_win_rates")
def test_checkpoints_side_by_side(tmp_path, tiny_model_dir, capsys):
    from tests.dist.tiny_llama import save_tiny_hf_dir
    from tools.evaluate import main

    other = save_tiny_hf_dir(tmp_path / "other", seed=1)
    ckpt = tmp_path / "converted"
    run_torchrun("convert_worker.py", "import", str(tiny_model_dir), str(ckpt), "2", "1")  # saved at TP=2
    step = tmp_path / "run" / "checkpoints" / "step_5"  # as a training run leaves it
    shutil.copytree(ckpt / "megatron", step)
    (step / "config.yaml").write_text(f"model: {{path: {tiny_model_dir}}}\n")

    never = _regression_file(tmp_path / "r0.jsonl", ["@@never@@"] * 3)
    names = [f"a={tiny_model_dir}", f"megatron={tmp_path / 'run'}", f"b={other}"]
    assert main(names + COMMON + ["--regression-file", never, "--out", str(tmp_path / "out1")]) == 0
    first = json.loads((tmp_path / "out1" / "results.json").read_text())
    items = first["items"]
    # the Megatron checkpoint (TP=2, exported once) answers exactly as the HF directory it came from
    assert items["megatron"] == items["a"] and first["metrics"]["megatron"] == first["metrics"]["a"]
    assert [i["text"] for i in items["b"]["arithmetic"]] != [i["text"] for i in items["a"]["arithmetic"]]
    assert set(first["metrics"]["a"]["arithmetic"]) == {"accuracy", "pass@1", "pass@2", "maj@2", "mean_length"}
    assert first["win_rates"]["b"]["verifier (arithmetic)"]["ties"] == 3  # both wrong everywhere
    assert (tmp_path / "out1" / "results.png").stat().st_size > 1000

    # answers only a's greedy text contains: b regresses, the Megatron copy does not
    texts = [i["text"].strip()[:12] for i in items["a"]["regression"]]
    assert all(t and t not in o["text"] for t, o in zip(texts, items["b"]["regression"]))
    gate = _regression_file(tmp_path / "r1.jsonl", texts)
    capsys.readouterr()
    assert main(names + COMMON + ["--regression-file", gate, "--out", str(tmp_path / "out2")]) == 1
    out = capsys.readouterr().out
    assert out.count("cached: arithmetic\n") == 3  # the regression file changed, the arithmetic suite did not
    assert "REGRESSION: b fails 3 item(s) a passes: q0, q1, q2" in out and "REGRESSION: megatron" not in out
    second = json.loads((tmp_path / "out2" / "results.json").read_text())
    assert second["regressions"] == {"megatron": [], "b": ["q0", "q1", "q2"]}
    assert second["items"]["a"]["arithmetic"] == items["a"]["arithmetic"]

    # vLLM at TP=2 (two processes): the same greedy answers
    assert main([f"a={tiny_model_dir}"] + COMMON + ["--regression-file", gate, "--tensor-parallel-size", "2",
                                                    "--out", str(tmp_path / "out3"), "--no-cache"]) == 0
    tp2 = json.loads((tmp_path / "out3" / "results.json").read_text())
    assert [i["text"] for i in tp2["items"]["a"]["arithmetic"]] == [i["text"] for i in items["a"]["arithmetic"]]
    assert tp2["metrics"]["a"]["regression"]["pass_rate"] == 1.0


def test_bad_arguments_fail_before_any_engine(tmp_path, tiny_model_dir, capsys):
    from tools.evaluate import main

    cases = [([str(tiny_model_dir), "--suites", "arithmetic,gsm9k"], "unknown gsm9k"),
             ([str(tiny_model_dir), "--suites", "preference"], "needs a judge: --reward-model"),
             ([str(tiny_model_dir), "--baseline", "zzz"], "--baseline 'zzz' is none of model"),
             ([f"x={tmp_path}"], "checkpoint x: " + str(tmp_path) + ": neither an HF directory"),
             ([str(tiny_model_dir), "--regression-file", str(tmp_path / "no.jsonl")], "no such file"),
             ([], "give at least one checkpoint")]
    for argv, message in cases:
        assert main(argv + ["--out", str(tmp_path / "o")]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "o").exists()
