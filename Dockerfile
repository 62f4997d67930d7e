# burst on CUDA: PyTorch's CUDA image plus flash-attn (BurstAttention's fastest local kernel on GPUs).
#
#   docker build -t burst .
#   docker run --gpus all --ipc=host -v "$PWD/runs:/work/runs" -v burst-cache:/cache \
#       burst train --model tiny --seq-len 131072 --cp 8
#
# The devel image carries nvcc, so flash-attn can compile when no prebuilt wheel matches.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    BURST_CACHE=/cache

# Slow and rarely changing: its own layer, before the sources.
RUN pip install packaging ninja && MAX_JOBS=8 pip install "flash-attn>=2.7" --no-build-isolation

WORKDIR /opt/burst
# Every package pyproject.toml installs (tests/test_packaging.py checks this list against it).
COPY pyproject.toml README.md cli.py ./
COPY burst burst
COPY runtime runtime
COPY data data
COPY models models
COPY checkpoints checkpoints
COPY trainer trainer
COPY evaluation evaluation
COPY bench bench
# torch is already in the image and satisfies the requirement, so pip keeps it.
RUN pip install .

# Runs go to /work/runs and the prepared default corpus to /cache: mount both to keep them.
WORKDIR /work
ENTRYPOINT ["burst"]
CMD ["train"]
