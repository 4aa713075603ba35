# imagetune: the web UI (and headless runs) on a CUDA GPU, for RunPod and other clouds. See README.md,
# "Docker and RunPod".
#
#   docker build -t imagetune .
#   docker run --gpus all -p 7860:7860 -v "$PWD/workspace:/workspace" -e IMAGETUNE_AUTH=me:secret imagetune
#
# CUDA and torch must match. The torch wheels from PyTorch's CUDA index carry their own CUDA runtime, cuDNN and
# NCCL as pip packages (torch 2.14.1+cu130 pins cuda-toolkit 13.0.x), so the base image is NVIDIA's small `base`
# flavour of the SAME CUDA major.minor (13.0): it gives what the wheels do not, the container-toolkit settings
# (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES) and NVIDIA_REQUIRE_CUDA=cuda>=13.0, so a host whose driver is
# too old (CUDA 13.0 needs driver 580+) is refused at start with a clear message instead of failing inside torch.
# A `-runtime` or `-cudnn-runtime` base would ship a second, unused copy of those libraries (about 3 GB).
# torch 2.14.1 / torchvision 0.29.1 are the versions the test-suite passes with; tests/test_docker.py checks that
# they satisfy pyproject.toml and that TORCH_CUDA names the base image's CUDA version. To build for another CUDA,
# change the four together, e.g. --build-arg CUDA_VERSION=12.8.1 --build-arg TORCH_CUDA=cu128
# --build-arg TORCH_VERSION=2.10.0 --build-arg TORCHVISION_VERSION=0.25.0 --build-arg XFORMERS_VERSION=0.0.35
# (CUDA 13 runs on Turing (T4, RTX 20xx) and newer; for older GPUs use a CUDA 12 build.)
# Ubuntu 24.04 for its Python 3.12 (the pinned numpy needs 3.11+; 22.04 has 3.10).
ARG CUDA_VERSION=13.0.1
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04

ARG TORCH_CUDA=cu130
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
# xformers is optional and off: its wheels are built for one exact torch (0.0.35 is for torch 2.10 + cu128; with
# torch 2.14 its kernels do not load), and torch's own scaled_dot_product_attention already uses FlashAttention /
# memory-efficient kernels (the plan's `sdpa`). Set it only together with the torch it was built for (see above).
ARG XFORMERS_VERSION=""
# Extras of pyproject.toml to install (comma-separated), e.g. ui,nf4,bnb. The default serves the web UI and every
# shipped preset (nf4: presets/flux-dev-lora-12gb.yaml's base weights) and the Dataset tab's every captioner (caption:
# timm, for the WD tagger); tests/test_docker.py holds it to that.
ARG EXTRAS=ui,nf4,caption

ARG DEBIAN_FRONTEND=noninteractive
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# python3 (3.12 on Ubuntu 24.04) in a venv, tini as PID 1. Apt versions are not pinned (DL3008 is ignored for
# this line only): Ubuntu's archive keeps only the newest build of a package, so a pinned version stops resolving
# at the next security update; the base image tag is what pins the distribution.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv tini \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# The non-root user of a fresh workspace (uid 1000; Ubuntu 24.04 images already have `ubuntu` there). The container
# starts as root and the entrypoint runs the app as the owner of /workspace: this user for the image's own folder or a
# named volume, the host user for a bind mount, root on RunPod (its volume and web terminal are root's). No USER line:
# see docker/entrypoint.py.
RUN if id ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --create-home --uid 1000 --user-group --shell /bin/bash imagetune \
    && mkdir -p /workspace \
    && chown imagetune:imagetune /workspace

# Layer 1 (rarely changes): torch from PyTorch's wheel index for this CUDA.
RUN pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
        "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
    && if [ -n "${XFORMERS_VERSION}" ]; then \
        pip install --no-cache-dir --no-deps --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
            "xformers==${XFORMERS_VERSION}"; \
    fi

# Layer 2 (changes with pyproject.toml): the dependencies, read from pyproject.toml, at the versions of
# docker/constraints.txt, with torch held at the build above.
WORKDIR /opt/imagetune
COPY pyproject.toml ./
COPY docker/constraints.txt docker/
RUN python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + [r for e in sys.argv[1].split(",") if e for r in p["optional-dependencies"][e]]))' \
        "${EXTRAS}" > /tmp/requirements.txt \
    && pip freeze | grep -E '^(torch|torchvision)==' > /tmp/torch.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt -c docker/constraints.txt -c /tmp/torch.txt \
    && rm /tmp/requirements.txt /tmp/torch.txt

# Layer 3 (changes with every commit): the source, installed in place (launch.py and presets/ run from here).
COPY . .
RUN pip install --no-cache-dir --no-deps --editable . \
    && chmod 755 docker/entrypoint.py \
    && ln -s /opt/imagetune/docker/entrypoint.py /usr/local/bin/imagetune

# Everything a user keeps lives in /workspace, so a pod restart or a new image loses nothing.
ENV IMAGETUNE_WORKSPACE=/workspace \
    IMAGETUNE_HOME=/workspace/imagetune \
    HF_HOME=/workspace/hf-cache \
    IMAGETUNE_PORT=7860 \
    GRADIO_ANALYTICS_ENABLED=False \
    HF_HUB_DISABLE_TELEMETRY=1
VOLUME ["/workspace"]
WORKDIR /workspace
EXPOSE 7860

# Healthy when the web UI answers HTTP (401 counts: the server is up, it wants the login); always healthy in
# headless mode. The first start imports gradio and probes the GPUs: give it two minutes.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["/opt/venv/bin/python", "/opt/imagetune/docker/entrypoint.py", "--healthcheck"]

# tini is PID 1: it passes docker stop's SIGTERM on and reaps orphaned processes. Headless, the entrypoint execs
# launch.py, which turns SIGTERM into a graceful stop (checkpoint, then `stopped`). With the web UI, the entrypoint
# stays the UI's parent and, when the UI ends, asks the runs it started for the same graceful stop and waits for them
# (they run in sessions of their own and would otherwise die with PID 1). Give a stop the time to save:
# docker stop -t 300 (or docker run --stop-timeout 300).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/venv/bin/python", "/opt/imagetune/docker/entrypoint.py"]
CMD []
