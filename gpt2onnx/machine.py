"""Where a figure was measured: the CPU (model and the instruction-set features onnxruntime's kernels choose by) or
the GPU. A leaf: nothing of ours is imported.

Quantized int8 kernels are the reason this matters: x86 CPUs without VNNI (AVX2, AVX-512 without VNNI) compute
uint8 × int8 products with VPMADDUBSW, whose 16-bit pair sums saturate; VNNI and AMX accumulate in 32 bits. The
same file can therefore give other logits on another CPU class, unless its weights cannot saturate
(precision.Int8Scheme). The features are read with the CPUID instruction in this process, which is what
onnxruntime's kernel dispatch reads too; under QEMU's user-mode emulator it returns the emulated CPU (its
/proc/cpuinfo shows the host). On aarch64 they come from the kernel's hardware capability bits (getauxval).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass

from gpt2onnx.records import OMIT_DEFAULT, Record, field

# x86-64 System V: void cpuid(uint32 leaf, uint32 subleaf, uint32 out[4]); rbx is callee-saved, so kept.
_CPUID_CODE = bytes.fromhex(
    "53"  # push rbx
    "4989d0"  # mov r8, rdx
    "89f8"  # mov eax, edi
    "89f1"  # mov ecx, esi
    "0fa2"  # cpuid
    "418900"  # mov [r8], eax
    "41895804"  # mov [r8+4], ebx
    "41894808"  # mov [r8+8], ecx
    "4189500c"  # mov [r8+12], edx
    "5b"  # pop rbx
    "c3"  # ret
)
# uint64 xgetbv(uint32 index): which register states the OS saves (AVX, AVX-512, AMX need it to)
_XGETBV_CODE = bytes.fromhex("89f90f01d048c1e2204809d0c3")

# (leaf, subleaf, register index: 0 eax 1 ebx 2 ecx 3 edx, bit) of each feature reported
_X86_FEATURES = {
    "sse4_1": (1, 0, 2, 19),
    "sse4_2": (1, 0, 2, 20),
    "fma": (1, 0, 2, 12),
    "avx": (1, 0, 2, 28),
    "f16c": (1, 0, 2, 29),
    "avx2": (7, 0, 1, 5),
    "avx512f": (7, 0, 1, 16),
    "avx512bw": (7, 0, 1, 30),
    "avx512vl": (7, 0, 1, 31),
    "avx512_vnni": (7, 0, 2, 11),
    "avx512_fp16": (7, 0, 3, 23),
    "amx_tile": (7, 0, 3, 24),
    "amx_int8": (7, 0, 3, 25),
    "avx_vnni": (7, 1, 0, 4),
    "avx512_bf16": (7, 1, 0, 5),
}
_NEEDS_OS_STATE = {  # XCR0 bits the OS must enable before the feature can be used
    "avx": 0b110,
    "fma": 0b110,
    "f16c": 0b110,
    "avx2": 0b110,
    "avx_vnni": 0b110,
    "avx512f": 0b11100110,
    "avx512bw": 0b11100110,
    "avx512vl": 0b11100110,
    "avx512_vnni": 0b11100110,
    "avx512_fp16": 0b11100110,
    "avx512_bf16": 0b11100110,
    "amx_tile": 0b110 << 16 | 0b110,
    "amx_int8": 0b110 << 16 | 0b110,
}
# aarch64 hardware capability bits (linux/arch/arm64/include/uapi/asm/hwcap.h)
_AT_HWCAP, _AT_HWCAP2 = 16, 26
_ARM_FEATURES = {"asimd": (_AT_HWCAP, 1), "asimddp": (_AT_HWCAP, 20), "sve": (_AT_HWCAP, 22), "i8mm": (_AT_HWCAP2, 13)}


@dataclass(frozen=True)
class CpuRecord(Record):
    """A CPU as onnxruntime's kernels see it: its model, architecture, features, and the int8 kernel path."""

    model: str
    arch: str
    features: tuple[str, ...] = ()
    int8_path: str = "unknown"

    def short(self) -> str:
        """The model and the int8 kernel family, e.g. 'AMD EPYC 7B13, AVX2'."""
        return f"{self.model}, {self.int8_path.split(' (')[0]}"

    def summary(self) -> str:
        shown = [f for f in self.features if f not in ("sse4_1", "fma", "f16c", "avx512vl")]
        return f"{self.model} ({self.arch}; {', '.join(shown) or 'no SIMD extensions read'}; int8: {self.int8_path})"


@dataclass(frozen=True)
class MachineRecord(Record):
    """Where a check or a measurement ran: the CPU always, the GPU when the provider was one."""

    cpu: CpuRecord
    gpu: str | None = field(default=None, omit=OMIT_DEFAULT)

    def summary(self) -> str:
        return f"{self.gpu} (host CPU {self.cpu.model})" if self.gpu else self.cpu.summary()

    def short(self) -> str:
        return self.gpu or self.cpu.short()


def _machine_function(code: bytes, restype, argtypes):
    """``code`` as a callable in an executable page (kept alive with the function); None where not allowed."""
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError, AttributeError):  # W^X policies (SELinux), or a platform without PROT_EXEC
        return None
    page.write(code)
    function = ctypes.CFUNCTYPE(restype, *argtypes)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    function.page = page
    return function


def _x86_cpu() -> CpuRecord:
    cpuid = _machine_function(_CPUID_CODE, None, (ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)))
    if cpuid is None:
        return CpuRecord(_proc_cpuinfo_model() or platform.processor() or "x86-64", "x86_64")

    def regs(leaf: int, subleaf: int = 0) -> tuple[int, int, int, int]:
        out = (ctypes.c_uint32 * 4)()
        cpuid(leaf, subleaf, out)
        return tuple(out)

    max_leaf = regs(0)[0]
    max_extended = regs(0x80000000)[0]
    brand = ""
    if max_extended >= 0x80000004:
        brand = b"".join(
            int(r).to_bytes(4, "little") for leaf in range(0x80000002, 0x80000005) for r in regs(leaf)
        ).decode("ascii", "replace")
        brand = " ".join(brand.replace("\x00", " ").split())
    leaves = {(1, 0): regs(1)}
    if max_leaf >= 7:
        leaves[(7, 0)] = regs(7, 0)
        if leaves[(7, 0)][0] >= 1:
            leaves[(7, 1)] = regs(7, 1)
    osxsave = bool(leaves[(1, 0)][2] >> 27 & 1)
    xcr0 = 0
    if osxsave:
        xgetbv = _machine_function(_XGETBV_CODE, ctypes.c_uint64, (ctypes.c_uint32,))
        xcr0 = xgetbv(0) if xgetbv is not None else 0
    features = []
    for name, (leaf, subleaf, register, bit) in _X86_FEATURES.items():
        values = leaves.get((leaf, subleaf))
        if values is None or not values[register] >> bit & 1:
            continue
        needs = _NEEDS_OS_STATE.get(name, 0)
        if needs and (xcr0 & needs) != needs:
            continue  # the CPU has it but the OS does not save its registers: no kernel may use it
        features.append(name)
    return CpuRecord(brand or platform.processor() or "x86-64", "x86_64", tuple(features), _x86_int8_path(features))


def _x86_int8_path(features: list[str]) -> str:
    """Which onnxruntime (MLAS) kernel family computes uint8 × int8 products on a CPU with these features."""
    if "amx_int8" in features:
        return "AMX (32-bit accumulation; used where the OS grants AMX, else AVX-512 VNNI)"
    if "avx512_vnni" in features:
        return "AVX-512 VNNI (32-bit accumulation)"
    if "avx512bw" in features:
        return "AVX-512 without VNNI (VPMADDUBSW: 16-bit pair sums saturate)"
    if "avx_vnni" in features:
        return "AVX-VNNI (32-bit accumulation)"
    if "avx2" in features:
        return "AVX2 (VPMADDUBSW: 16-bit pair sums saturate)"
    return "SSE4.1 (16-bit products widened to 32 bits)"


def _arm_cpu() -> CpuRecord:
    features = []
    try:
        getauxval = ctypes.CDLL(None).getauxval
        getauxval.restype, getauxval.argtypes = ctypes.c_ulong, (ctypes.c_ulong,)
        for name, (kind, bit) in _ARM_FEATURES.items():
            if getauxval(kind) >> bit & 1:
                features.append(name)
    except (OSError, AttributeError):
        pass
    path = "i8mm (SMMLA)" if "i8mm" in features else "dot product (SDOT/UDOT)" if "asimddp" in features else "NEON"
    return CpuRecord(_proc_cpuinfo_model() or platform.processor() or "aarch64", "aarch64", tuple(features), path)


def _proc_cpuinfo_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
            for line in file:
                if line.startswith(("model name", "Model", "Hardware")):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        return None
    return None


@functools.lru_cache(maxsize=1)
def describe_cpu() -> CpuRecord:
    """This process's CPU, as onnxruntime's kernels see it (read once)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64") and sys.platform != "win32":
        return _x86_cpu()
    if machine in ("aarch64", "arm64") and sys.platform.startswith("linux"):
        return _arm_cpu()
    return CpuRecord(platform.processor() or machine, machine)


@functools.lru_cache(maxsize=4)
def _gpu_name(device_id: int) -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return f"GPU {device_id} (nvidia-smi not found: model unknown)"
    try:
        query = [smi, f"--id={device_id}", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        line = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"GPU {device_id} (nvidia-smi failed: model unknown)"
    name, _, driver = line.partition(",")
    return f"{name.strip()} (driver {driver.strip()})" if driver else name.strip()


def describe_machine(provider: str = "cpu", device_id: int = 0) -> MachineRecord:
    """Where a run on ``provider`` computes: the CPU, plus the GPU for a GPU provider."""
    return MachineRecord(describe_cpu(), None if provider in ("cpu", "openvino") else _gpu_name(device_id))


@dataclass(frozen=True)
class MachineInfo(Record):
    """The machine a folder was measured on: gpt2onnx.machine's record (the CPU as the kernels see it, the GPU)
    with the platform, Python, CPU count and memory."""

    cpu: CpuRecord
    gpu: str | None = field(default=None, omit=OMIT_DEFAULT)
    platform: str = ""
    python: str = ""
    cpu_count: int | None = None
    memory_bytes: int | None = field(default=None, omit=OMIT_DEFAULT)  # None where /proc/meminfo is unread

    @property
    def record(self) -> MachineRecord:
        return MachineRecord(self.cpu, self.gpu)


def machine_info() -> MachineInfo:
    """This machine, described (:class:`MachineInfo`)."""
    memory = None
    try:
        with open("/proc/meminfo") as fh:
            memory = int(fh.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    machine = describe_machine()
    return MachineInfo(machine.cpu, machine.gpu, platform.platform(), platform.python_version(), os.cpu_count(), memory)
