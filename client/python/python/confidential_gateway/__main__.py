"""``python -m confidential_gateway verify-receipt ...``: offline checks, the
same code and arguments as ``gateway verify receipt`` (and
``verify-evidence``, ``verify-attestation``), for people without Rust; and
``python -m confidential_gateway pin ...``, ``gateway policy pin`` (a policy
pinning what a gateway reports: trust on first use, development only), and
``python -m confidential_gateway from-build RECORD --out POLICY``,
``gateway policy from-build`` (a policy from the build record of a
reproducible build of the stage image)."""

import sys

from ._native import main, policy_main

_VERBS = {"verify-receipt": "receipt", "verify-evidence": "evidence",
          "verify-attestation": "attestation"}


def run(argv: list) -> int:
    """Runs a verb; returns the exit code (0 verified, 1 failed, 2 usage)."""
    if argv and argv[0] in ("pin", "from-build"):
        return policy_main(argv)
    if argv and argv[0] in _VERBS:
        argv = [_VERBS[argv[0]], *argv[1:]]
    elif argv and argv[0] == "verify":
        argv = argv[1:]
    elif not argv or argv[0] not in ("-h", "--help"):
        print("usage: python -m confidential_gateway "
              "{verify-receipt,verify-evidence,verify-attestation,pin,from-build} [ARGS...] "
              "(--help on each)",
              file=sys.stderr)
        return 2
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
