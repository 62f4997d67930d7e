# burst on CUDA: PyTorch's CUDA image plus what `--attention-kernel auto` chooses on a GPU (docs/kernels.md):
# FlashAttention-4 on Hopper and Blackwell, else cuDNN attention, which comes with torch.
#
#   docker build -t burst .
#   docker run --gpus all --ipc=host -v "$PWD/runs:/work/runs" -v burst-cache:/cache \
#       burst train --model tiny --seq-len 131072 --cp 8
#
# Nothing compiles at build time: FA4 is pure Python and generates its kernels when first called, with the
# compiler its nvidia-cutlass-dsl dependency ships (an NVIDIA driver of CUDA 12.9's or newer). flash-attn 2
# (an hour's build from source) is not installed: cuDNN and FA4 outrun it on sm90.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    BURST_CACHE=/cache

# Slow and rarely changing: its own layer, before the sources. FA4 has pre-releases only: a pinned one
# (burst's tests read this version's signatures); on a CUDA 13 base image use 'flash-attn-4[cu13]==...'.
RUN pip install "flash-attn-4==4.0.0b40"

WORKDIR /opt/burst
# Every package pyproject.toml installs (tests/test_packaging.py checks this list against it).
COPY pyproject.toml README.md cli.py ./
COPY burst burst
COPY runtime runtime
COPY data data
COPY models models
COPY checkpoints checkpoints
COPY planner planner
COPY trainer trainer
COPY evaluation evaluation
COPY bench bench
# torch is already in the image and satisfies the requirement, so pip keeps it.
RUN pip install .

# Runs go to /work/runs and the prepared default corpus to /cache: mount both to keep them.
WORKDIR /work
ENTRYPOINT ["burst"]
CMD ["train"]
