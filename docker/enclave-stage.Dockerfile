# The enclave image: one pipeline stage, FROM scratch. It is the input to
# `nitro-cli build-enclave` and the image of the compose stages.
#
# Build context: target/images/<tag>/stage/ or target/eif/<name>/stage/,
# assembled by scripts/build-images.sh or scripts/build-eif.sh (do not build
# it by hand); it is the image's whole file system, copied in one layer:
#   enclave-stage                 static (musl) release binary
#   models/<MODEL>/               the model files and manifest.json
#   config/policy.toml            the policy that pins the stage measurement
#                                 (used to verify the neighbouring stages)
# One `COPY . /` (not one COPY per path): COPY gives a folder it has to
# create the time of the build, while a folder copied from the context keeps
# the context's time, which the scripts fix at SOURCE_DATE_EPOCH, so the same
# inputs give the same layer (docs/deploy-nitro.md, "Reproducible builds").
#
# The model folder is the build argument MODEL (all-minilm-l6-v2, or
# smollm2-135m-instruct for the completions stages), passed to the stage as
# STAGE_MODEL_DIR. The arguments that differ per stage (index, count, layers,
# listen address, generation limits) come from CMD; the defaults run the
# whole embedding model as a single stage. scripts/build-eif.sh derives the
# enclave image from this one with a CMD for Nitro (vsock, --attestation nitro).
FROM scratch
ARG MODEL=all-minilm-l6-v2
ENV STAGE_MODEL_DIR=/models/${MODEL}
COPY . /
# No user database in a scratch image: a numeric unprivileged id.
USER 65534:65534
EXPOSE 9000
# The stage exits cleanly on SIGINT (Ctrl-C); it installs no SIGTERM handler,
# and as PID 1 it would ignore SIGTERM until `docker stop` kills it.
STOPSIGNAL SIGINT
ENTRYPOINT ["/enclave-stage", "--policy", "/config/policy.toml"]
CMD ["--listen", "tcp://0.0.0.0:9000", "--stage-index", "0", "--num-stages", "1", "--layers", "0..6"]
