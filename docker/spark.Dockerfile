# syntax=docker/dockerfile:1
# Spark preprocessing image: Java 17, pyspark 3.5 and the project's preprocessing code,
# without TensorFlow or Horovod; optionally the RAPIDS Accelerator jar (docs/docker.md).
#   docker build -f docker/spark.Dockerfile -t dlrm-spark .
#   docker build -f docker/spark.Dockerfile -t dlrm-spark:rapids --build-arg \
#     RAPIDS_JAR_URL=https://repo1.maven.org/maven2/com/nvidia/rapids-4-spark_2.12/25.12.0/rapids-4-spark_2.12-25.12.0.jar .
#   docker run --rm -v "$PWD/raw:/data/raw:ro" -v "$PWD/out:/runs" dlrm-spark \
#     python -m preproc.criteo --input_dir /data/raw --output_dir /runs/criteo
# Same Python (3.11.7, Debian bookworm) as CI and the CPU training image.
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
FROM ${PYTHON_IMAGE}
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]

# Java 17 for Spark 3.5 (the package install.sh installs too), ps for Spark's launch
# scripts, curl for the optional RAPIDS jar.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        openjdk-17-jre-headless procps curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/dlrm
# pyspark, numpy and pyyaml at the versions constraints.txt pins for the whole project.
COPY constraints.txt ./
COPY docker/requirements-spark.txt docker/
RUN python -m venv .venv \
    && .venv/bin/pip install --no-cache-dir -r docker/requirements-spark.txt -c constraints.txt

# Optional RAPIDS Accelerator (`python -m preproc.criteo --gpu --rapids_jar
# /opt/rapids/rapids-4-spark.jar`): the URL of a released rapids-4-spark_2.12-X.Y.Z.jar
# built for Spark 3.5 (a fixed version, no SNAPSHOT), and optionally its sha256. Empty:
# no jar. Running it needs `docker run --gpus all` (the driver comes from the host).
ARG RAPIDS_JAR_URL=
ARG RAPIDS_JAR_SHA256=
RUN if [ -n "$RAPIDS_JAR_URL" ]; then \
        jar="${RAPIDS_JAR_URL##*/}"; \
        if ! printf '%s\n' "$jar" \
                | grep -Eqx 'rapids-4-spark_2\.12-[0-9]+\.[0-9]+\.[0-9]+\.jar'; then \
            echo "RAPIDS_JAR_URL: expected .../rapids-4-spark_2.12-X.Y.Z.jar (a released" \
                 "version), got '$RAPIDS_JAR_URL'" >&2; \
            exit 1; \
        fi; \
        mkdir -p /opt/rapids; \
        curl -fsSL --retry 3 -o "/opt/rapids/$jar" "$RAPIDS_JAR_URL"; \
        if [ -n "$RAPIDS_JAR_SHA256" ]; then \
            echo "$RAPIDS_JAR_SHA256  /opt/rapids/$jar" | sha256sum -c -; \
        fi; \
        ln -s "/opt/rapids/$jar" /opt/rapids/rapids-4-spark.jar; \
    fi

COPY . .
# Spark's Python workers run the venv's interpreter and import preproc from here.
ENV PATH=/opt/dlrm/.venv/bin:$PATH PYSPARK_PYTHON=/opt/dlrm/.venv/bin/python
RUN useradd --uid 1000 --user-group --create-home --shell /bin/bash dlrm \
    && install -d -o dlrm -g dlrm /data /runs
USER 1000:1000
CMD ["python", "-m", "preproc.criteo", "--help"]
