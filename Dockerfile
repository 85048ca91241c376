# syntax=docker/dockerfile:1
# fencegate's container image: built with the dependency versions in Cargo.lock, run as an
# unprivileged user on Debian bookworm-slim (which has /bin/sh, for the Kubernetes
# init-data-dir step). The build's cache mounts (RUN --mount=type=cache) need BuildKit, which
# the legacy `docker build` is not; podman (buildah) has them too. From the repository root:
#
#   DOCKER_BUILDKIT=1 docker build -t fencegate:0.1.0 .    (or: docker buildx build, podman build)
#
# docs/deployment.md has the commands to initialise the volume and run it.

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM docker.io/library/rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS build
WORKDIR /src
COPY . .
# --locked: exactly Cargo.lock's versions, or fail. The caches keep downloaded crates and
# compiled dependencies between builds; the binary is copied out of the cached target/.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin fencegate \
 && install -D -m 0755 target/release/fencegate /out/fencegate

FROM docker.io/library/debian:${DEBIAN_RELEASE}-slim
# ca-certificates: the system roots, trusted for an https:// backend without backend.tls.ca.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# uid and gid 65532, as distroless's "nonroot"; the Kubernetes manifest runs as this user.
RUN groupadd --system --gid 65532 fencegate \
 && useradd --system --uid 65532 --gid fencegate --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin fencegate \
 && install -d -m 0700 -o fencegate -g fencegate /var/lib/fencegate
COPY --from=build /out/fencegate /usr/local/bin/fencegate
COPY deploy/container/fencegate.toml /etc/fencegate/fencegate.toml
USER 65532:65532
# store.dir. A new volume is empty, and `run` refuses it until `fencegate init` has run once.
VOLUME ["/var/lib/fencegate"]
# server.listen, and admin.listen's port: on loopback in this config, on every interface where
# FENCEGATE_ADMIN__LISTEN=0.0.0.0:8081 asks for it (the Kubernetes manifest does).
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/fencegate"]
CMD ["run", "--config", "/etc/fencegate/fencegate.toml"]
