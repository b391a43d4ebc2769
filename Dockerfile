# The cona image for the Kubernetes backend (kubernetes.image in a profile): CUDA runtime, a pinned CUDA build of
# torch, and cona installed from this checkout. The orchestrator and the trainer pods use the same image.
#
# NOTE: this image cannot be built in the project's sandbox (no network, no container runtime); it is checked only
# by review. Build it with `docker build -t <registry>/cona:<version> .` on a machine with network access.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first and pinned (its own layer, reused across cona changes); `pip install .` then keeps it.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

COPY pyproject.toml README.md /src/
COPY protocol /src/protocol
COPY orchestrator /src/orchestrator
COPY trainer /src/trainer
# The extras: TensorBoard scalars (metrics.tensorboard) and `cona data prepare` work in the image too.
RUN pip install "/src[tensorboard,data]" && rm -rf /src

# A non-root user with a fixed UID: the rendered pods run as 1000:1000 (runAsNonRoot, fsGroup for the PVC).
# (Ubuntu 24.04 images ship a user `ubuntu` with UID 1000; it is replaced.)
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 cona && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin cona
USER 1000:1000
WORKDIR /home/cona

# The Job's container command runs torchrun itself (`python -m torch.distributed.run ... -m cona.trainer`).
CMD ["cona", "--help"]
