"""The ``megalign`` command (``tools/cli.py``): subcommands dispatch to the tools, ``train
--print-config`` shows what a job runs with, and a bad input a rank meets (past the command's own
checks) still ends in one line and exit status 2, with no traceback from any rank. The catalogue
of bad inputs through ``megalign train --dry-run`` is ``tests/test_bad_inputs.py``."""

from __future__ import annotations

import pytest
import yaml

from launchers.console import ERROR_FILE_ENV
from tools import cli


def test_unknown_command_is_one_line_and_status_2(capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["megalign: error: unknown command 'trian': one of train, convert, evaluate, plan, profile, "
                   "init-model, plot, rerank, vision-task"]


def test_help_lists_every_subcommand(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in ("train", "convert", *cli.TOOLS):
        assert f"\n  {name} " in out


def test_plan_dispatches_to_the_planner(capsys):
    """``megalign plan`` is ``tools/plan_layout.py``: the same table for the same arguments."""
    from tools import plan_layout

    args = ["--model", "qwen3-1.7b", "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gib", "80"]
    assert cli.main(["plan", *args]) == 0
    via_cli = capsys.readouterr().out
    plan_layout.main(args)
    assert capsys.readouterr().out == via_cli and "TP" in via_cli


def test_print_config_shows_the_jobs_values_not_the_schema_defaults(capsys):
    """The schema's ``trainer.lr`` is 1e-6; grpo.yaml sets 5e-6, and an override wins."""
    from alignment.config import JobConfig

    assert JobConfig().trainer.lr == 1e-6
    assert cli.main(["train", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["trainer"]["lr"] == 5e-6 and cfg["algorithm"]["name"] == "grpo"
    assert cli.main(["train", "--config-name", "sft", "--print-config", "trainer.lr=3e-5"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["trainer"]["lr"] == 3e-5 and cfg["algorithm"]["name"] == "sft"
    assert "${" not in yaml.safe_dump(cfg)  # interpolations resolved


def test_unknown_option_is_one_line(capfd):
    assert cli.main(["train", "--nprocs", "2"]) == 2
    out, err = capfd.readouterr()
    assert (out + err).splitlines() == ["megalign: error: unknown option '--nprocs': megalign train takes --nproc, "
                                        "--nnodes, --dry-run, --print-config, --debug, --config-name, --config-dir and key=value "
                                        "overrides"]


@pytest.mark.slow
def test_a_ranks_bad_input_is_one_line_without_tracebacks(tmp_path, capfd):
    """Past the command's checks (called here without them), 2 ranks that meet a bad input each
    write its one line and exit 2 (the first to fail sets the status): no traceback, no launcher
    report; the command prints the line once."""
    errors = tmp_path / "error"
    status = cli.launch(cli.TRAIN_SCRIPT, ["--config-name=grpo", "parallel.tensor_model_parallel_size=2",
                                           f"output_dir={tmp_path / 'out'}"], nproc=2,
                        env={ERROR_FILE_ENV: str(errors)})
    out, err = capfd.readouterr()
    assert status == 2
    assert "Traceback" not in out + err and "ChildFailedError" not in out + err, out + err
    lines = errors.read_text().splitlines()  # one per rank, unless the launcher stopped one first
    assert 1 <= len(lines) <= 2 and len(set(lines)) == 1
    assert lines[0].startswith("megalign: error: parallel.tensor_model_parallel_size=2 must divide the model's 9 "
                               "attention heads")


def test_a_ranks_other_failure_keeps_its_traceback(tmp_path, capfd):
    """What is no bad input (a bug, a crash) is not hidden: the rank's traceback shows and the
    status is the rank's."""
    script = tmp_path / "crash.py"
    script.write_text("raise RuntimeError('boom')\n")
    status = cli.launch(script, [], nproc=1, env={ERROR_FILE_ENV: str(tmp_path / "error")})
    out, err = capfd.readouterr()
    assert status == 1 and "RuntimeError: boom" in out + err
    assert not (tmp_path / "error").exists()


def test_the_launcher_leaves_signal_handlers_as_they_were(tmp_path):
    """torch's launcher installs handlers that raise SignalException; after a launch this process
    handles SIGINT (and the others) as before, e.g. a reward function's timeout."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in cli.LAUNCHER_SIGNALS}
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    assert cli.launch(script, [], nproc=1) == 0
    assert {sig: signal.getsignal(sig) for sig in cli.LAUNCHER_SIGNALS} == before
