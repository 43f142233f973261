"""gpt2onnx/runtimes/heap.py: the process's freed memory given back, its large blocks mapped on their own."""

import subprocess
import sys
import textwrap

import pytest

# in a process of its own: mallopt changes the whole process's heap, and this one runs every other test
PROBE = textwrap.dedent(
    """
    import ctypes, ctypes.util, sys
    from gpt2onnx.runtimes.heap import LARGE_BLOCK, map_large_blocks

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = Mallinfo2
    if sys.argv[1] == "mapped":
        assert map_large_blocks()
    size, mapped = LARGE_BLOCK + (1 << 20), []
    for _ in range(3):  # as a server's steps do: allocated, freed, again
        before = libc.mallinfo2().hblkhd
        block = bytearray(size)
        mapped.append(libc.mallinfo2().hblkhd - before >= size)
        del block
        mapped.append(libc.mallinfo2().hblkhd == before)
    print(all(mapped))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_large_block_gets_a_mapping_of_its_own_and_goes_back_when_freed():
    """After map_large_blocks, a block of LARGE_BLOCK bytes or more is one of malloc's mapped blocks (mallinfo2's
    hblkhd counts them) while it lives, and unmapped when freed, every time; glibc left to itself serves it from
    the heap once it has freed one (its threshold rises), where the freed block then stays."""

    def probe(mode: str) -> str:
        run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert probe("mapped") == "True"
    assert probe("default") == "False"
