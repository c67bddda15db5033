# The image `persia-launcher k8s` manifests run: persia_py and its CPU dependencies.
#   docker build -t REGISTRY/persia-py:TAG .
# For GPUs, start FROM an image with CUDA and the torch you want, and drop the
# constraints file (it pins the CPU build of torch).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/persia_py

COPY setup.cfg pyproject.toml README.md ./
COPY requirements ./requirements
COPY persia_py ./persia_py
COPY servers ./servers
COPY workers ./workers
COPY proto ./proto
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu \
        -c requirements/cpu-constraints.txt . \
    && useradd --create-home --uid 1000 persia

# Jobs' scripts (training, data loader) go under /app; the examples come along.
COPY examples /app/examples
WORKDIR /app
USER persia
ENTRYPOINT []
CMD ["persia-launcher", "--help"]
