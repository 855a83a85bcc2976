# The enclave image: one pipeline stage, FROM scratch. It is the input to
# `nitro-cli build-enclave` and the image of the compose stages.
#
# Build context: target/images/<tag>/stage/, assembled by
# scripts/build-images.sh (do not build it by hand):
#   enclave-stage                 static (musl) release binary
#   models/all-minilm-l6-v2/      the model files and manifest.json
#   policy.toml                   the policy that pins the stage measurement
#                                 (used to verify the neighbouring stages)
#
# The arguments that differ per stage (index, count, layers, listen address)
# come from CMD; the defaults run the whole model as a single stage.
FROM scratch
COPY enclave-stage /enclave-stage
COPY models/ /models/
COPY policy.toml /config/policy.toml
# No user database in a scratch image: a numeric unprivileged id.
USER 65534:65534
EXPOSE 9000
# The stage exits cleanly on SIGINT (Ctrl-C); it installs no SIGTERM handler,
# and as PID 1 it would ignore SIGTERM until `docker stop` kills it.
STOPSIGNAL SIGINT
ENTRYPOINT ["/enclave-stage", "--model-dir", "/models/all-minilm-l6-v2", "--policy", "/config/policy.toml"]
CMD ["--listen", "tcp://0.0.0.0:9000", "--stage-index", "0", "--num-stages", "1", "--layers", "0..6"]
