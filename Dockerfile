# syntax=docker/dockerfile:1.7
# Images for dsv4. Targets:
#   operator       the kopf operator (no torch): `dsv4 operator`
#   engine-cpu     the engine on CPU (tests, laptops): `dsv4 serve`, plus sglang-router for the router pods
#   engine-ascend  the engine on Ascend NPUs (CANN base image with torch_npu); the default target
# Build: docker build --target operator -t dsv4-operator:0.1.0 .
#        docker build --target engine-ascend -t dsv4:0.1.0 .                           # Atlas A3 (910C)
#        docker build --target engine-ascend --build-arg ASCEND_CHIP=910b -t dsv4:0.1.0-910b .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# CANN 9.1.0 is the toolkit torch_npu 2.14.0 is built for (its README; Ascend/pytorch COMPATIBILITY.md
# pairs the 26.1.0 releases with 9.1.0). quay.io/ascend/cann publishes one image per chip family:
# `a3` for Atlas A3 (910C), `910b` for Atlas A2 (910B); the node's driver must support this CANN.
ARG CANN_VERSION=9.1.0
ARG ASCEND_CHIP=a3
ARG CANN_IMAGE=quay.io/ascend/cann:${CANN_VERSION}-${ASCEND_CHIP}-ubuntu22.04-py3.11
ARG TORCH_VERSION=2.14.0
ARG TORCH_NPU_VERSION=2.14.0

FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY engine ./engine
RUN pip install ".[operator]" && rm -rf /src
USER 65532:65532
ENTRYPOINT ["dsv4", "operator"]

FROM ${PYTHON_IMAGE} AS engine-cpu
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
# Mooncake's transfer engine links libibverbs and libnuma even for its TCP transport.
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY engine ./engine
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
    && pip install ".[engine]" "sglang-router==0.3.2" && rm -rf /src
# The fused CPU kernels, built with a compiler this layer then drops: the servers import the library
# from DSV4_KERNELS_PREBUILT as it is (a slim image has no compiler to build it at start).
ENV DSV4_KERNELS_PREBUILT=/opt/dsv4/kernels
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && XDG_CACHE_HOME=/tmp/kernels-build python -m dsv4_engine.kernels --prebuilt-dir "${DSV4_KERNELS_PREBUILT}" \
    && rm -rf /tmp/kernels-build \
    && apt-get purge -y --auto-remove g++ && rm -rf /var/lib/apt/lists/*
# The CPU example's model (examples/cpu-tiny.yaml, model.image.path), baked in: kind needs no volume.
# tiny-v2 is a new revision of it (same shapes and tokenizer, other weights, so another fingerprint
# and other greedy replies): the e2e rollout scenario moves the example to it.
RUN dsv4 make-tiny /opt/dsv4/models/tiny --seed 0 && dsv4 make-tiny /opt/dsv4/models/tiny-v2 --seed 1
USER 65532:65532
ENTRYPOINT ["dsv4"]
CMD ["serve", "--help"]

FROM ${CANN_IMAGE} AS engine-ascend
ARG TORCH_VERSION
ARG TORCH_NPU_VERSION
# The gid of HwHiAiUser, the group that owns the driver's files and devices on the nodes (MindCluster
# creates it as 1000); the operator adds the same gid to the pod (spec.ascend.driverGroupId).
ARG ASCEND_DRIVER_GID=1000
# CANN writes its logs and kernel cache under $HOME by default: /tmp is the pod's writable emptyDir.
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    ASCEND_PROCESS_LOG_PATH=/tmp/ascend/log ASCEND_CACHE_PATH=/tmp/ascend/cache
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY engine ./engine
# The `ascend` extra pins torch, torch_npu and Mooncake's Ascend build (tests/packaging/test_ascend_pins.py
# resolves it); the build args must agree with it. torch comes from PyTorch's CPU index first: on x86_64
# PyPI's torch wheel would pull CUDA libraries the NPU never uses (vllm-ascend does the same).
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
    && pip install ".[ascend]" "torch==${TORCH_VERSION}" "torch-npu==${TORCH_NPU_VERSION}" "sglang-router==0.3.2" \
    && rm -rf /src
COPY --chmod=755 docker/ascend-entrypoint.sh /usr/local/bin/dsv4-ascend
RUN (getent group "${ASCEND_DRIVER_GID}" >/dev/null || groupadd --gid "${ASCEND_DRIVER_GID}" HwHiAiUser) \
    && useradd --uid 65532 --gid "${ASCEND_DRIVER_GID}" --no-create-home --shell /usr/sbin/nologin dsv4
WORKDIR /tmp
USER 65532:${ASCEND_DRIVER_GID}
ENTRYPOINT ["dsv4-ascend"]
CMD ["serve", "--help"]
