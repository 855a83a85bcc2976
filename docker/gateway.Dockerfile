# The gateway image, FROM scratch.
#
# Build context: target/images/<tag>/gateway/, assembled by
# scripts/build-images.sh (do not build it by hand):
#   gateway                                    static (musl) release binary
#   gateway.toml                               docker/gateway.toml (remote stages
#                                              at tcp://stage0:9000, tcp://stage1:9000)
#   policy.toml                                the policy that pins the stage measurement
#   models/all-minilm-l6-v2/manifest.json      the model manifest (the gateway
#                                              needs no weights)
#   data/                                      empty: the receipt store's folder
FROM scratch
COPY gateway /gateway
COPY gateway.toml /config/gateway.toml
COPY policy.toml /config/policy.toml
COPY models/ /models/
# The receipt store's folder (compose mounts a volume here; the root file
# system is read-only).
COPY --chown=65534:65534 data/ /data/
USER 65534:65534
EXPOSE 8080
# The gateway shuts down gracefully on SIGTERM (docker stop's default).
ENTRYPOINT ["/gateway"]
CMD ["serve", "--config", "/config/gateway.toml"]
