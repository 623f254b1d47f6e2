"""This process's resident memory and its peak over a window of work (Linux /proc).

The peak comes from the kernel (VmHWM, the high-water mark of the resident set), reset at the start
of a window by writing 5 to /proc/self/clear_refs: exact, with no sampling thread to miss a short
spike. Where the reset is not allowed, the peak is the process's lifetime peak (never lower than the
window's). Freed memory that glibc keeps for reuse is returned to the system (malloc_trim) before a
window starts and before "what stays" is read, so what a build keeps is not inflated by the heap's
free lists.

glibc serves an allocation from its heap once it is below a threshold that it raises to the size of
each large block freed (up to 32 MiB); freed heap memory stays with the process. Loading or exporting
a model allocates and frees one large tensor after another, so the heap grows by up to half a model
(measured: 0.46x at megatron TP 2) that is never used again. `large_allocations_returned` fixes the
threshold low around such work: each large tensor gets its own mapping, returned when it is freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import re

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int:
    with open(_STATUS) as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise OSError(f"{_STATUS} has no {field} line: resident memory is read from Linux's /proc")
    return int(match.group(1))


def resident_bytes() -> int:
    """The process's resident set now (VmRSS)."""
    return _status_kib("VmRSS") * 1024


def peak_resident_bytes() -> int:
    """The resident set's high-water mark since the last reset_peak (VmHWM)."""
    return _status_kib("VmHWM") * 1024


def reset_peak() -> bool:
    """Start a new peak window; False where the kernel does not allow it (the peak is then the
    process's lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def release_free_heap() -> None:
    """Hand glibc's free heap memory back to the system (no-op without glibc)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_GLIBC_MAX_THRESHOLD = 32 * 2**20  # the most glibc's own threshold adjustment reaches (64-bit)
_depth = 0  # open large_allocations_returned windows (nested ones leave the outer one's setting)


def _libc():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "mallopt") else None


@contextlib.contextmanager
def large_allocations_returned(threshold: int = 2**20):
    """Inside, glibc maps every allocation of `threshold` bytes or more on its own and unmaps it when
    it is freed, so loading or exporting a model tensor by tensor does not leave the freed tensors
    in the heap. After, the threshold stays fixed at 32 MiB (where glibc's adjustment would have
    taken it), the trim threshold at twice that. A no-op without glibc; nested, the outermost
    window decides. Not thread-safe: engines are built and exported from one thread."""
    global _depth
    libc = _libc()
    if libc is None or _depth:  # without glibc, or inside another such window: as it is
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MAX_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _GLIBC_MAX_THRESHOLD)
        release_free_heap()


@dataclasses.dataclass
class MemoryWindow:
    """`with MemoryWindow() as window:` around some work: window.base (resident at the start),
    window.peak (the highest resident set during it) and window.after (resident at the end, free
    heap released), in bytes."""

    base: int = 0
    peak: int = 0
    after: int = 0

    def __enter__(self) -> "MemoryWindow":
        release_free_heap()
        self.base = resident_bytes()
        reset_peak()
        return self

    def __exit__(self, *exc) -> None:
        self.peak = peak_resident_bytes()
        release_free_heap()
        self.after = resident_bytes()

    @property
    def transient(self) -> int:
        """Peak minus what stays: memory the work needed only while it ran."""
        return self.peak - self.after

    @property
    def kept(self) -> int:
        return self.after - self.base
