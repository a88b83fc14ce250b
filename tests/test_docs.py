"""The docs site, the README and CONTRIBUTING.md cannot go stale: the site builds with ``mkdocs build --strict``
(broken links fail it), the config-field reference equals what the schema generates, every config
key and repository path a page names exists, and every job command a page shows composes and
passes the config check for its world size (``megalign train``'s checks before any process)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typing import Any

from omegaconf import OmegaConf

from tests.count_tests import counts, sentence

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
SECTIONS = ("model", "parallel", "data", "rollout", "algorithm", "reward", "trainer", "profile", "cluster")
TOP_DIRS = ("alignment", "parallel", "launchers", "tools", "bench", "configs", "tests", "slurm", "scripts", "docs",
            "evals", "examples")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _text_outside_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    built = {p.relative_to(tmp_path / "site").parent for p in (tmp_path / "site").rglob("index.html")}
    assert len(built) >= len(PAGES) - 2  # every page of docs/ became a page of the site (not README, CONTRIBUTING)


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, f"{page} is not in mkdocs.yml's nav"


def test_config_fields_page_is_generated_from_the_schema():
    from tools.config_reference import page

    assert (ROOT / "docs" / "reference" / "config-fields.md").read_text() == page(), \
        "docs/reference/config-fields.md is stale: python -m tools.config_reference > docs/reference/config-fields.md"


def _schema_has(key: str) -> bool:
    """``key`` is a field of the schema, or a key inside a free-form field (``data.columns.prompt``,
    ``data.generator_kwargs.min_terms``) or a list of records (``reward.functions``)."""
    from alignment.config import JobConfig

    node = OmegaConf.structured(JobConfig)
    for part in key.split("."):
        if OmegaConf.is_list(node) or node is None or (OmegaConf.is_dict(node) and node._metadata.object_type is dict):
            return True  # inside a list, an Any field or a plain dict: free-form keys
        if not OmegaConf.is_dict(node) or part not in node:
            return False
        node = node._get_node(part)
        if not OmegaConf.is_config(node) and node._metadata.ref_type is Any:
            node = None
    return True


def config_keys(text: str) -> set[str]:
    """Dotted config keys in inline code (``trainer.lr``, ``trainer.lr=5e-6``)."""
    keys = set()
    for code in re.findall(r"`([^`\n]+)`", _text_outside_code(text)):
        for m in re.finditer(r"(?<![\w./$-])((?:%s)(?:\.[a-z_][a-z0-9_]*)+)" % "|".join(SECTIONS), code):
            keys.add(m.group(1))
    return keys


#: pages that name keys which are not megalign's on purpose: the bad-inputs catalogue (wrong keys), the page of
#: the other projects' option names (their keys, checked apart: test_every_megalign_key_of_the_mapping_exists)
OTHER_KEYS = ("bad-inputs.md", "coming-from.md")


def test_the_algorithms_table_is_the_registry():
    """docs/guides/algorithms.md's table of the algorithms is :func:`alignment.algorithms.registry.table`."""
    from alignment.algorithms.registry import table

    assert table() in (ROOT / "docs" / "guides" / "algorithms.md").read_text(), \
        "docs/guides/algorithms.md: paste python -m alignment.algorithms.registry's table"


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in OTHER_KEYS], ids=_rel)
def test_every_config_key_named_exists(page):
    """(The pages of :data:`OTHER_KEYS` name other keys on purpose.)"""
    text = page.read_text()
    missing = sorted(k for k in config_keys(text) if not _schema_has(k))
    assert not missing, f"{_rel(page)} names config keys the schema does not have: {missing}"


def test_every_megalign_key_of_the_mapping_exists():
    """docs/guides/coming-from.md: every row of its option tables names at least one megalign key (its second
    column), and every key there exists; at least 20 rows per project."""
    text = (ROOT / "docs" / "guides" / "coming-from.md").read_text()
    rows = {}
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        name = section.split()[0]
        rows[name] = [line.split(" | ") for line in section.splitlines()
                      if line.startswith("| `") and line.count(" | ") >= 2]
    assert set(rows) == {"TRL", "verl", "OpenRLHF"} and all(len(r) >= 20 for r in rows.values()), \
        {k: len(v) for k, v in rows.items()}
    for name, table in rows.items():
        for cells in table:
            keys = config_keys(cells[1]) | ({cells[1].strip("` ")} if cells[1].strip("` ") in ("run_name",) else set())
            assert keys, f"{name}: {cells[0]} names no megalign key"
            missing = sorted(k for k in keys if not _schema_has(k))
            assert not missing, f"{name}: {cells[0]} -> {missing}: not in megalign's schema"


def repo_paths(text: str) -> set[str]:
    """Repository paths in inline code and links (``alignment/rewards/judge.py``, ``configs/data/``)."""
    found = set()
    for code in re.findall(r"`([^`\n]+)`", _text_outside_code(text)) + re.findall(r"\]\(([^)#\s]+)", text):
        for token in re.split(r"[\s,;()'\"]+", code):
            token = token.strip(".:")
            if token.startswith(tuple(d + "/" for d in TOP_DIRS)) and not re.search(r"[<>*{}$]|\.\.\.", token):
                found.add(token.split("::")[0].split(":")[0])
    return found


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_path_named_exists(page):
    text = page.read_text()
    base = page.parent
    missing = []
    for path in sorted(repo_paths(text)):
        if not ((ROOT / path).exists() or (base / path).exists()):
            missing.append(path)
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


# ---------------------------------------------------------------------------------- commands

SBATCH_CONFIG = {"grpo": "grpo", "sft": "sft", "rm": "rm", "dpo": "dpo", "ppo": "ppo"}


def commands(text: str) -> list[str]:
    """Every line of the page's ``bash`` blocks (continuations joined, comments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def job_of(line: str):
    """``(config name, overrides, world size)`` of a job command, or None for another command.
    The forms: ``megalign train``, ``bash scripts/train.sh``, ``torchrun ... launchers/train.py``,
    ``sbatch ... slurm/<job>.sbatch``."""
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if not words:
        return None
    nproc, nodes, rest = 1, 1, None
    if words[:2] == ["megalign", "train"]:
        rest, opts = [], iter(words[2:])
        for w in opts:
            if w == "--nproc":
                nproc = int(next(opts))
            elif w == "--nnodes":
                nodes = int(next(opts))
            elif w == "--rdzv-endpoint":
                next(opts)
            elif w in ("--dry-run", "--print-config", "--debug"):
                continue
            else:
                rest.append(w)
    elif words[:2] == ["bash", "scripts/train.sh"]:
        rest, nproc = words[2:], int(env.get("NPROC", 2))
    elif words[0] == "torchrun" and "launchers/train.py" in words:
        i = words.index("launchers/train.py")
        for j, w in enumerate(words[:i]):
            if w.startswith("--nproc-per-node"):
                nproc = int(w.split("=", 1)[1] if "=" in w else words[j + 1])
        rest = words[i + 1:]
    elif words[0] == "sbatch" and any(w.startswith("slurm/") for w in words):
        i = next(j for j, w in enumerate(words) if w.startswith("slurm/"))
        nodes = next((int(w.split("=")[1]) for w in words[:i] if w.startswith("--nodes=")), 1)
        nproc = 8  # the scripts' --ntasks-per-node
        name = env.get("MEGALIGN_CONFIG") or SBATCH_CONFIG[Path(words[i]).stem]
        return name, words[i + 1:], nproc * nodes
    else:
        return None
    name, overrides = "grpo", []
    it = iter(rest)
    for w in it:
        if w == "--config-name":
            name = next(it)
        elif w.startswith("--config-name="):
            name = w.split("=", 1)[1]
        elif not w.startswith("-"):
            overrides.append(w)
    return name, overrides, nproc * nodes


def all_jobs():
    jobs = []
    for page in PAGES:
        for line in commands(page.read_text()):
            if "<" in line or "..." in line:
                continue  # a template, not a command
            job = job_of(line)
            if job is not None:
                jobs.append(pytest.param(*job, id=f"{_rel(page)}: {line[:80]}"))
    return jobs


def test_the_pages_show_jobs():
    assert len(all_jobs()) >= 20


@pytest.mark.parametrize("name,overrides,world", all_jobs())
def test_every_job_command_composes_and_passes_the_config_check(name, overrides, world, tmp_path, monkeypatch):
    """The config check of ``megalign train --dry-run`` (:func:`launchers.preflight.check`: the schema,
    then the layout and the values against the model and the world size). A model that an earlier
    step makes or the user brings (``outputs/...``, ``/models/...``) gets the layout check alone; the
    PRM's data directory, which ``megalign`` makes in the step before, is stood in for."""
    from launchers.preflight import check, compose

    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "prm_data").mkdir(parents=True)
    for split in ("train", "heldout"):
        (tmp_path / "outputs" / "prm_data" / f"{split}.jsonl").write_text("")
    path = compose(name, overrides).model.path
    cfg = check(name, overrides, world, resolve_model=path == "smollm2" or Path(path).exists())
    p = cfg.parallel  # the layout the command asks for fits the processes it starts
    assert world % (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size) == 0


def test_other_commands_exist():
    """``megalign <command>`` lines name real subcommands; script paths exist."""
    from tools.cli import TOOLS

    known = {"train", "convert", *TOOLS}
    for page in PAGES:
        for line in commands(page.read_text()):
            words = line.split()
            if words[0] == "megalign":
                assert words[1] in known, f"{_rel(page)}: {line}"
            for w in words:
                if w.endswith((".py", ".sh", ".sbatch")) and "/" in w and not w.startswith(("/", "$", "<")):
                    assert (ROOT / w).exists(), f"{_rel(page)}: {line}: no {w}"


# ---------------------------------------------------------------------------------- figures' commands

def script_commands() -> dict[str, dict[str, set[str]]]:
    """``script -> {flag -> pages}`` for every ``python bench/...py`` / ``python tools/...py`` /
    ``python -m tools....`` a page shows (in a ``bash`` block or inline), with the ``--flags`` it gives."""
    found: dict[str, dict[str, set[str]]] = {}
    for page in PAGES:
        text = page.read_text()
        inline = re.findall(r"`([^`]*?python (?:-m [\w.]+|[\w/]+\.py)[^`]*)`", _text_outside_code(text))
        lines = commands(text) + [" ".join(i.split()) for i in inline]
        for line in lines:
            m = re.search(r"python (-m (?:tools|bench)\.[\w.]+|(?:bench|tools)/[\w/]+\.py)", line)
            if not m:
                continue
            script = m.group(1)
            flags = found.setdefault(script, {})
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", line[m.end():]):
                flags.setdefault(flag, set()).add(_rel(page))
    return found


@pytest.mark.slow  # one --help per script: a process each
def test_every_script_command_takes_the_flags_the_pages_give(tmp_path):
    """The commands that produced the docs' figures can be run as written: each script a page shows
    answers ``--help``, and lists every ``--flag`` the page gives it."""
    found = script_commands()
    assert "bench/random_kills.py" in found and "--window" in found["bench/random_kills.py"], sorted(found)
    wrong = []
    for script, flags in sorted(found.items()):
        cmd = [sys.executable, *script.split()] if script.startswith("-m") else [sys.executable, script]
        done = subprocess.run([*cmd, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        if done.returncode != 0:
            wrong.append(f"{script} --help: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
            continue
        wrong += [f"{script} {flag} (in {', '.join(sorted(pages))}): not in its --help"
                  for flag, pages in sorted(flags.items()) if flag != "--help" and
                  not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", done.stdout)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow  # collects the whole suite in a subprocess (~15 s)
def test_the_pages_one_figure_of_the_suite_is_its_size():
    """docs/getting-started.md gives the suite's size once, as ``python -m tests.count_tests`` prints it."""
    got = sentence(counts())
    assert got in (ROOT / "docs" / "getting-started.md").read_text(), f"docs/getting-started.md: write {got!r}"
