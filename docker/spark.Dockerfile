# Spark preprocessing image: Java 17, pyspark 3.5 and the project (its preprocessing
# needs no TensorFlow or Horovod, and neither is installed); optionally the RAPIDS
# Accelerator jar (docs/docker.md).
#   docker build -f docker/spark.Dockerfile -t dlrm-spark .
#   docker build -f docker/spark.Dockerfile -t dlrm-spark:rapids --build-arg \
#     RAPIDS_JAR_URL=https://repo1.maven.org/maven2/com/nvidia/rapids-4-spark_2.12/25.12.0/rapids-4-spark_2.12-25.12.0.jar .
#   docker run --rm -v "$PWD/raw:/data/raw:ro" -v "$PWD/out:/runs" dlrm-spark \
#     dlrm-preprocess --input_dir /data/raw --output_dir /runs/criteo
# Without a package index: fill docker/wheelhouse/ with packaging/wheelhouse.sh first.
# With podman, add --format docker (the OCI format drops SHELL).
# Debian bookworm (Python 3.11), as the CPU training image; named in full so that
# podman finds a base imported without a registry (docs/docker.md) under the same name
# that docker pulls.
ARG DEBIAN_IMAGE=docker.io/library/debian:bookworm-slim

# The checkout less docker/wheelhouse/, for the final stage's copy: the wheels are
# mounted where they are used and would otherwise stay in a layer of the image.
FROM ${DEBIAN_IMAGE} AS checkout
COPY . /checkout
RUN rm -rf /checkout/docker/wheelhouse

FROM ${DEBIAN_IMAGE}
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]

# Python with venv, Java 17 for Spark 3.5 (the package install.sh installs too), ps for
# Spark's launch scripts, curl for the optional RAPIDS jar, nss_wrapper for
# docker/entrypoint.sh.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv openjdk-17-jre-headless procps curl ca-certificates \
        libnss-wrapper \
    && apt-get clean && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/dlrm
# pyspark, pyarrow, pandas, numpy and pyyaml at the versions constraints.txt pins for
# the whole project. docker/wheelhouse/ is mounted, not copied: when it holds wheels
# (packaging/wheelhouse.sh), pip takes every package from it and no index.
COPY constraints.txt ./
COPY docker/requirements-spark.txt docker/
RUN --mount=type=bind,source=docker/wheelhouse,target=/wheelhouse \
    if [ -n "$(find /wheelhouse -maxdepth 1 -name '*.whl' -print -quit)" ]; then \
        export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; \
    fi; \
    python3 -m venv .venv \
    && .venv/bin/pip install --no-cache-dir -r docker/requirements-spark.txt -c constraints.txt

# Optional RAPIDS Accelerator (`dlrm-preprocess --gpu --rapids_jar
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

COPY --from=checkout /checkout/ ./
# The project as a package, without its dependencies (it declares no TensorFlow; the
# ones preprocessing needs are installed above): dlrm-preprocess and dlrm-synthetic on
# PATH. Its build backend (setuptools) comes from the wheelhouse or the index, and the
# build's leftovers in the source tree are removed.
RUN --mount=type=bind,source=docker/wheelhouse,target=/wheelhouse \
    if [ -n "$(find /wheelhouse -maxdepth 1 -name '*.whl' -print -quit)" ]; then \
        export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; \
    fi; \
    .venv/bin/pip install --no-cache-dir --no-deps . \
    && rm -rf build ./*.egg-info
# Spark's Python workers run the venv's interpreter, which imports the project.
ENV PATH=/opt/dlrm/.venv/bin:$PATH PYSPARK_PYTHON=/opt/dlrm/.venv/bin/python
RUN useradd --uid 1000 --user-group --create-home --shell /bin/bash dlrm \
    && install -d -o dlrm -g dlrm /data /runs
# Lets `--user` name any uid, such as the host user's (docker/entrypoint.sh).
COPY docker/entrypoint.sh /usr/local/bin/dlrm-entrypoint
USER 1000:1000
ENTRYPOINT ["/bin/sh", "/usr/local/bin/dlrm-entrypoint"]
CMD ["dlrm-preprocess", "--help"]
