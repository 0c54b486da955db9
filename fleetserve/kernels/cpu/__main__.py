"""`python -m fleetserve.kernels.cpu`: build the CPU kernels into the cache now (make set-up)."""

from __future__ import annotations

import sys

from fleetserve.kernels.cpu.build import load_cpu_kernels


def main() -> int:
    kernels = load_cpu_kernels()
    if kernels.error is not None:
        print(kernels.error, file=sys.stderr)
        return 1
    print(f"{'built' if kernels.built else 'cached'}: {kernels.library}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
