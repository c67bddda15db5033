# The image `persia-launcher k8s` manifests run: persia_py and its dependencies.
#   docker build -t REGISTRY/persia-py:TAG .
# The default installs the CPU build of torch. For NN workers on GPUs, build with torch's
# wheel index of a CUDA release your driver supports (pytorch.org lists them for the
# torch version requirements/cpu-constraints.txt pins; the wheels bring their own CUDA
# libraries, so the base image stays the same), e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       -t REGISTRY/persia-py:TAG-cuda .
# See docs/running.md#gpus.
FROM python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/persia_py

COPY setup.cfg pyproject.toml README.md ./
COPY requirements ./requirements
COPY persia_py ./persia_py
COPY servers ./servers
COPY workers ./workers
COPY proto ./proto
RUN pip install --extra-index-url ${TORCH_INDEX_URL} \
        -c requirements/cpu-constraints.txt . \
    && useradd --create-home --uid 1000 persia

# Jobs' scripts (training, data loader) go under /app; the examples come along.
COPY examples /app/examples
WORKDIR /app
USER persia
ENTRYPOINT []
CMD ["persia-launcher", "--help"]
