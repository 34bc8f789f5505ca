#!/usr/bin/env bash
# What a session with a GPU runs, in under 5 minutes on one H100 (docs/clusters.md, "Tested
# torch versions and GPUs"): the card, make gpu-check (its two-ranks-on-one-GPU table and its
# larger size included), and two nccl ranks on fewer GPUs, which must stop in one line.
# Usage, at the repository's root: bash bench/gpu_session.sh [PYTHON]   (default .venv/bin/python)
set -u
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
started=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
timeout 240 "$PY" -m course.instructors.gpu_check
echo "gpu-check exit status $? after $((SECONDS - started)) s"
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
echo "--- $((gpus + 1)) nccl ranks on $gpus GPU(s): one line, exit status 2"
timeout 60 "$PY" solutions/mydp.py --world-size $((gpus + 1)) --backend nccl --niters 10
echo "exit status $?; whole session $((SECONDS - started)) s"
