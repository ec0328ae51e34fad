#!/bin/sh
# Entrypoint of the training and Spark images: runs the command it is given, after
# making a user id that the image does not know usable.
#
# `docker run --user "$(id -u):$(id -g)"` is how outputs on a mounted directory come to
# belong to the host user (docs/docker.md). docker gives such a user no passwd entry
# and HOME=/, which it cannot write: Java then has no home directory (Spark fails on
# "?/.ivy2"), Hadoop's login inside Spark fails without a user name, and horovodrun
# cannot create its cache under $HOME. podman adds a passwd entry itself, but may
# also leave a HOME the user cannot write.
set -eu

if ! id -un >/dev/null 2>&1; then
    # nss_wrapper answers the C library's user and group look-ups from copies that
    # hold one more entry, so /etc/passwd itself stays read-only.
    home="$(mktemp -d)"
    cp /etc/passwd /etc/group "$home/"
    echo "user$(id -u):x:$(id -u):$(id -g):container user:$home:/bin/sh" >>"$home/passwd"
    id -gn >/dev/null 2>&1 || echo "group$(id -g):x:$(id -g):" >>"$home/group"
    export LD_PRELOAD="libnss_wrapper.so${LD_PRELOAD:+ $LD_PRELOAD}"
    export NSS_WRAPPER_PASSWD="$home/passwd" NSS_WRAPPER_GROUP="$home/group" HOME="$home"
elif [ ! -w "${HOME:-/}" ]; then
    HOME="$(mktemp -d)"
    export HOME
fi
exec "$@"
