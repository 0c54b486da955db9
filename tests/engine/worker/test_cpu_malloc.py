"""glibc's malloc tuning of CPU engine processes (`fleetserve.engine.worker.cpu_malloc`): a tuned
process keeps the memory of a freed activation for the next step instead of unmapping it (and
faulting every page in again), and the switch and the log say what was done. Each case runs in a
fresh interpreter, since the thresholds are process-wide and cannot be set back. (What it buys:
the module docstring's prefill figures.) What the heap keeps, `release_free_heap` gives back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from fleetserve.engine.worker.cpu_malloc import tune_cpu_malloc

_PROBE = textwrap.dedent(
    """
    import ctypes, json, sys
    from fleetserve.engine.worker.cpu_malloc import release_free_heap, tune_cpu_malloc

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def resident_kib():
        status = open("/proc/self/status").read().splitlines()
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1])

    tuning = tune_cpu_malloc(sys.argv[1] == "1")
    size = 30 << 20  # a prefill step's gate/up output is 25 MB (SmolLM2, 2048 tokens)
    mapped = libc.mallinfo2().hblks
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    own_mapping = libc.mallinfo2().hblks - mapped
    libc.free(block)
    kept = libc.mallinfo2().fordblks >= size
    resident = resident_kib()
    released = release_free_heap()
    print(json.dumps({"applied": tuning.applied, "reason": tuning.reason,
                      "own_mapping": own_mapping, "kept": kept, "released": released,
                      "released_mib": (resident - resident_kib()) / 1024}))
    """
)


def _probe(enabled: bool) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, "1" if enabled else "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
def test_a_tuned_process_keeps_an_activations_memory_for_the_next_step() -> None:
    untuned, tuned = _probe(False), _probe(True)
    assert untuned["applied"] is False and "FLEETSERVE_CPU_MALLOC_TUNING=0" in str(
        untuned["reason"]
    )
    assert tuned["applied"] is True and "glibc" in str(tuned["reason"])
    # glibc's default maps such a block on its own and unmaps it on free (every page faulted in
    # again next step); tuned, it comes from the heap and its memory stays there, free.
    assert (untuned["own_mapping"], untuned["kept"]) == (1, False), untuned
    assert (tuned["own_mapping"], tuned["kept"]) == (0, True), tuned
    # What the heap keeps, release_free_heap gives back at once (start-up's one-off frees).
    assert tuned["released"] is True and float(str(tuned["released_mib"])) >= 25, tuned


def test_the_choice_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="fleetserve.engine.worker.cpu_malloc"):
        tuning = tune_cpu_malloc(False)
    assert not tuning.applied
    assert "CPU malloc: glibc defaults (FLEETSERVE_CPU_MALLOC_TUNING=0)" in caplog.text
