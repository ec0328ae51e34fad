# CPU image of the project: the same install script as `make install`, so the
# tested path and the image path are one. The GPU image (CUDA base, Horovod with
# NCCL + MPI) and the Spark/RAPIDS stage come with the launch issue.
#   docker build -t dlrm-hybrid .
#   docker run --rm dlrm-hybrid .venv/bin/python -m pytest tests/unit
FROM python:3.11.7-slim-bookworm

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 TF_CPP_MIN_LOG_LEVEL=2
WORKDIR /opt/dlrm

# install.sh installs these itself as root; listing them here keeps the layer cached.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        g++ cmake make libhighwayhash-dev libfarmhash-dev openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*

COPY requirements.txt requirements-dev.txt constraints.txt ./
COPY packaging/ packaging/
RUN TENSORFLOW_VARIANT=cpu bash packaging/install.sh && rm -rf .cache

COPY . .
RUN useradd --create-home dlrm && chown -R dlrm /opt/dlrm
USER dlrm
ENV PATH=/opt/dlrm/.venv/bin:$PATH
CMD ["python", "main.py", "--help"]
