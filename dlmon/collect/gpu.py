"""GPU collector: device memory, utilisation and per-process VRAM through NVML.

Every NVML call goes through one choke point, :meth:`GpuCollector._query`. It returns the
sentinel :data:`NA` instead of raising when NVML says a value is not there (not supported, not
found, no permission, GPU lost, unknown, function not found, library not found, driver not
loaded, any other ``NVMLError``), and likewise when the installed ``pynvml`` is too old to have
the function at all. Nothing here raises out of :meth:`GpuCollector.sample`; a value that could
not be read is ``None`` in the returned dataclasses, never 0.

``pynvml`` (the ``nvidia-ml-py`` package) is imported lazily on first use, so this module imports
on machines without it. It never imports torch, rich or textual.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

from dlmon.collect.procfs import ns_inode, nspids
from dlmon.model.snapshot import GpuDevice, GpuProcess, GpuStatus

__all__ = ["NA", "GpuCollector", "NVMLErrorKind"]

#: NVML's ``NVML_VALUE_NOT_AVAILABLE`` for unsigned long long fields (e.g. ``usedGpuMemory`` in
#: containers or under WDDM).
ULONGLONG_MAX: Final = (1 << 64) - 1

#: The inode of the initial (host) pid namespace, a kernel constant (PROC_PID_INIT_INO).
PROC_PID_INIT_INO: Final = 0xEFFFFFFC

#: Size of the driver's nvmlProcessInfo_t, which the _v2 and _v3 process lists fill.
DRIVER_PROCESS_INFO_BYTES: Final = 24

#: Linux's PID_MAX_LIMIT on 64-bit: no pid is 0 or above it. An entry outside means the
#: bindings and the driver disagree on the process struct's layout.
PID_MAX_LIMIT: Final = 1 << 22

#: NVML's clock event ("throttle") reasons that hold the clocks down, by bit. Idle, application
#: clocks, sync boost and display clocks are settings or rest, not slowdowns: left out.
CLOCK_EVENTS: Final = (
    (0x04, "sw power cap"),
    (0x08, "hw slowdown"),
    (0x20, "sw thermal"),
    (0x40, "hw thermal"),
    (0x80, "power brake"),
)

#: How far back a per-process utilisation read looks at least (NVML keeps a buffer of samples;
#: a read asks for those after the newest one seen, or after this long ago if that is sooner).
FIRST_UTIL_LOOKBACK_US: Final = 1_000_000

#: NVML's field ids of the PCIe byte counters (NVML_FI_DEV_PCIE_COUNT_RX_BYTES, _TX_BYTES):
#: cumulative counts, read with their timestamps; nvmlDeviceGetPcieThroughput is not used (it
#: samples for 20 ms inside each call).
PCIE_RX_FIELD: Final = 198
PCIE_TX_FIELD: Final = 197
#: The counters "can be wrapped" (nvml.h): only 64-bit ones (nvmlValueType_t 2, unsigned long; 3,
#: unsigned long long) give rates. A 32-bit one wraps every 4 GiB, under 0.1 s at PCIe Gen5 speed:
#: how often it wrapped between sweeps cannot be known, and its rate would be short by 4 GiB a wrap.
PCIE_COUNTER_MEMBERS: Final = {2: "ulVal", 3: "ullVal"}
NVML_NOT_SUPPORTED: Final = 3

#: NVML's GPM metric ids (NVML_GPM_METRIC_SM_UTIL, _SM_OCCUPANCY) and its request version.
GPM_SM_UTIL: Final = 2
GPM_SM_OCCUPANCY: Final = 3
GPM_METRICS_GET_VERSION: Final = 1

MISREAD_PROCESSES: Final = "process list misread (entries with impossible pids left out)"

CONTAINER_PIDS_NOTE: Final = (
    "per-process VRAM unavailable: dlmon runs in a container's pid namespace and NVML lists host "
    "pids, which cannot be matched to the pids seen here (run dlmon on the host, or with --pid=host); "
    "each GPU counts the processes NVML lists instead"
)


def host_pids_visible(proc_root: str = "/proc") -> bool | None:
    """Whether the pids in ``proc_root`` are host pids, as NVML reports them; None: cannot tell.

    /proc shows host pids when its namespace is the host's: its pid 1 then lives in the initial
    namespace. When that link is unreadable (not root): dlmon itself in the host namespace means
    yes; dlmon in a nested namespace whose NSpid has one entry means /proc is that namespace's own.
    """
    init = ns_inode(f"{proc_root}/1/ns/pid")
    if init is not None:
        return init == PROC_PID_INIT_INO
    if ns_inode(f"{proc_root}/self/ns/pid") == PROC_PID_INIT_INO:
        return True
    ours = nspids("self", proc_root)  # how many pid namespaces this /proc's pid lists
    return False if ours is not None and len(ours) == 1 else None


#: A device (or MIG device) whose read was cut short: it took longer than ``slow_device_s``.
SLOW_REASON: Final = "NVML: slow to answer"

#: ``NVML_DEVICE_MIG_ENABLE``: nvmlDeviceGetMigMode's current mode when MIG is on.
MIG_ENABLE: Final = 1
#: More MIG devices than any card has (A100/H100/H200: 7), should a driver answer nonsense.
MAX_MIG_SLOTS: Final = 64

#: How long a failed ``nvmlInit`` (or a missing ``pynvml``) is remembered before trying again.
DEFAULT_RETRY_INTERVAL_S: Final = 60.0

#: A device whose reading took longer than the collector's ``slow_device_s`` is not read again for
#: this long, doubling while it stays slow, up to :data:`MAX_BACKOFF_S`: a GPU that fell off the
#: bus, or a GSP RPC timing out, blocks every call on it for tens of seconds.
FIRST_BACKOFF_S: Final = 5.0
MAX_BACKOFF_S: Final = 60.0


class _NAType(enum.Enum):
    NA = "NA"

    def __repr__(self) -> str:
        return "NA"

    def __bool__(self) -> bool:
        return False


#: "Not available": what the choke point returns instead of raising.
NA: Final = _NAType.NA


class NVMLErrorKind(enum.Enum):
    """Why the last NVML query returned :data:`NA`."""

    NOT_SUPPORTED = "not supported"
    NOT_FOUND = "not found"
    NO_PERMISSION = "no permission"
    GPU_IS_LOST = "GPU is lost"
    UNKNOWN = "unknown error"
    FUNCTION_NOT_FOUND = "function not found"  # in the driver, or in an old pynvml
    LIBRARY_NOT_FOUND = "NVML library not found"
    DRIVER_NOT_LOADED = "driver not loaded"
    UNINITIALIZED = "NVML not initialised"  # the driver was reloaded under a running NVML
    OTHER = "other NVML error"


# pynvml exception class name -> kind. Classes missing from a library are skipped.
_ERROR_CLASSES: Final = (
    ("NVMLError_NotSupported", NVMLErrorKind.NOT_SUPPORTED),
    ("NVMLError_NotFound", NVMLErrorKind.NOT_FOUND),
    ("NVMLError_NoPermission", NVMLErrorKind.NO_PERMISSION),
    ("NVMLError_GpuIsLost", NVMLErrorKind.GPU_IS_LOST),
    ("NVMLError_Unknown", NVMLErrorKind.UNKNOWN),
    ("NVMLError_FunctionNotFound", NVMLErrorKind.FUNCTION_NOT_FOUND),
    ("NVMLError_LibraryNotFound", NVMLErrorKind.LIBRARY_NOT_FOUND),
    ("NVMLError_DriverNotLoaded", NVMLErrorKind.DRIVER_NOT_LOADED),
    ("NVMLError_Uninitialized", NVMLErrorKind.UNINITIALIZED),
)

#: Errors of a running NVML that mean it must be started again: the driver was reloaded (NVML's
#: state went with it: every call answers UNINITIALIZED), or unloaded.
_RESTART_KINDS: Final = (NVMLErrorKind.UNINITIALIZED, NVMLErrorKind.DRIVER_NOT_LOADED)
#: Errors that answer "not on this device" (the others say nothing of it).
_NOT_THERE: Final = (NVMLErrorKind.NOT_SUPPORTED, NVMLErrorKind.FUNCTION_NOT_FOUND)

# Process listings, newest variant first. The plain name is v1 in old pynvml releases and a
# dispatcher to the newest in recent ones (which raises NVMLLibraryMismatchError, not an
# NVMLError, when the driver lacks that symbol).
_PROCESS_LISTS: Final = (
    (
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses",
    ),
    (
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses",
    ),
    (
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
        "nvmlDeviceGetMPSComputeRunningProcesses",
    ),
)


class _DeviceLost(Exception):
    """Internal: a query on this device said NVML_ERROR_GPU_IS_LOST; stop reading it."""


class _Restart(Exception):
    """Internal: NVML answered as if not started (a driver reload): start it again."""


class _DeviceSlow(Exception):
    """Internal: reading this device has taken longer than ``slow_device_s``; stop reading it."""


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def _bytes_or_none(value: Any) -> int | None:
    if value is None or value is NA or isinstance(value, bool):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    if number < 0 or number >= ULONGLONG_MAX:
        return None
    return number


def _str_or_none(value: Any) -> str | None:
    value = _decode(value)
    return value if isinstance(value, str) and value else None


def _unattributed(device: GpuDevice) -> GpuDevice:
    """``device`` in a container's pid namespace: its processes' host pids match none here, so
    they are counted, with their VRAM, rather than listed (where a local process sharing the
    number would be given a stranger's VRAM, or every GPU would look like the job's)."""
    if device.is_mig_parent:
        return device
    listed = [p.used_memory_bytes for p in device.processes]
    known = [m for m in listed if m is not None]
    return dataclasses.replace(
        device,
        processes=(),
        unattributed_processes=len(listed),
        unattributed_memory_bytes=sum(known) if known else (0 if not listed else None),
    )


def _init_failure_reason(kind: NVMLErrorKind, error: BaseException) -> str:
    if kind is NVMLErrorKind.LIBRARY_NOT_FOUND:
        return "NVML library not found: the NVIDIA driver is not installed or not visible here."
    if kind is NVMLErrorKind.DRIVER_NOT_LOADED:
        return "NVIDIA driver not loaded: NVML could not talk to the GPU driver."
    if kind is NVMLErrorKind.NO_PERMISSION:
        return "No permission to use NVML on this machine."
    text = str(error).strip().rstrip(".") or type(error).__name__
    if "mismatch" in text.lower():
        return f"NVML failed to start ({text}); the driver was likely upgraded without a reload."
    return f"NVML failed to start: {text}."


class GpuCollector:
    """Reads NVIDIA GPUs through NVML, once per :meth:`sample`.

    ``library`` is the ``pynvml`` module, or any object with the same names (tests pass a fake);
    when ``None`` it is imported on first use. NVML is initialised lazily, once; when that fails
    every :meth:`sample` returns ``GpuStatus(available=False, reason=...)`` and no devices, and
    initialisation is retried at most once every ``retry_interval_s`` seconds.
    """

    def __init__(
        self,
        library: object | None = None,
        *,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        host_pids: bool | None = None,
        slow_device_s: float | None = None,
    ) -> None:
        self._lib: Any = library
        #: A device read slower than this is backed off (None: never).
        self._slow_device_s = slow_device_s
        # Per device index: (last reading: the card, then its MIG devices; when it was taken), and
        # (not before, last back-off).
        self._last_reading: dict[int, tuple[tuple[GpuDevice, ...], float]] = {}
        self._backoff: dict[int, tuple[float, float]] = {}
        self._newly_slow_s = 0.0  # of this sample, on devices it backed off
        self._device_start = 0.0  # when the device being read was started on
        #: Seconds the last :meth:`sample` spent on devices not newly backed off, NVML's start
        #: left out: what the sweep paces its next one on (a hang or a slow nvmlInit is not).
        self.pace_s = 0.0
        #: False inside a container's pid namespace: NVML's pids are not ours, so no per-process
        #: VRAM (rather than VRAM given to whichever local process shares the number).
        self._host_pids = host_pids if host_pids is not None else host_pids_visible() is not False
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._initialized = False
        self._failure: GpuStatus | None = None
        self._next_attempt = float("-inf")
        self._driver_version: str | None = None
        self._error_kinds: tuple[tuple[type[BaseException], NVMLErrorKind], ...] = ()
        self._nvml_error: type[BaseException] | None = None
        self._mismatch_error: type[BaseException] | None = None
        # Per device index: NVML handle, and name/uuid that never change while the handle lives.
        self._handles: dict[int, Any] = {}
        self._static: dict[int, tuple[str | None, str | None]] = {}
        # Per device index: N of its /dev/nvidiaN (None: NVML does not say).
        self._minor: dict[int, int | None] = {}
        # Per device index: whether it is in MIG mode (changing it takes a GPU reset).
        self._mig_mode: dict[int, bool] = {}
        # MIG cards whose aggregate memory NVML refused (no privileges): not asked again.
        self._no_aggregate: set[int] = set()
        # Per device index: the newest per-process utilisation sample seen (µs, NVML's CPU
        # timestamp), and the energy counter's last reading (mJ, at this clock's time).
        self._util_seen: dict[int, int] = {}
        self._energy: dict[int, tuple[int, float]] = {}
        # Per device index: the PCIe counters' last reading, field id -> (bytes, µs timestamp).
        self._pcie: dict[int, dict[int, tuple[int, int]]] = {}
        # Per device index: whether GPM is supported (asked once), and its sample of the last sweep.
        self._gpm_supported: dict[int, bool] = {}
        self._gpm_sample: dict[int, Any] = {}
        # (device index, function) of the extras a device said NOT_SUPPORTED to: not asked again
        # (each sweep would pay for them on every such device).
        self._unsupported: set[tuple[int, str]] = set()
        # Function names found missing (in pynvml or in the driver): not tried again.
        self._missing: set[str] = set()
        self._memory_v2: bool | None = None  # None: not yet known
        # NVML errors while reading one device: (figure being read, kind, NVML's words).
        self._device_errors: list[tuple[str, NVMLErrorKind, str]] = []
        self._figure = "name"  # the figure the device's queries are for, for its errors
        self._partial_mig: GpuDevice | None = None  # a MIG device whose read was cut short
        #: Why the last query returned NA (None after a successful one). For diagnostics.
        self.last_error: NVMLErrorKind | None = None
        #: The exception behind :attr:`last_error`, if any.
        self.last_exception: BaseException | None = None

    # -- public --------------------------------------------------------------------------------

    def sample(self) -> tuple[GpuStatus, tuple[GpuDevice, ...]]:
        """One reading of every GPU NVML sees. Never raises for NVML trouble."""
        with self._lock:
            self.pace_s = 0.0
            failure = self._ensure_initialized()
            if failure is not None:
                return failure, ()
            begin = self._clock()
            self._newly_slow_s = 0.0
            try:
                try:
                    return self._sample_devices()
                except _Restart:
                    pass
                # The driver was reloaded under us: start NVML again, and read once more.
                kind = self.last_error
                self._restart()
                failure = self._ensure_initialized()
                if failure is not None:
                    return failure, ()
                try:
                    return self._sample_devices()
                except _Restart:
                    self._restart()
                    what = (self.last_error or kind or NVMLErrorKind.UNINITIALIZED).value
                    return GpuStatus(
                        available=False,
                        reason=f"NVML answered '{what}' again right after restarting; retrying next sweep.",
                        driver_version=self._driver_version,
                    ), ()
            finally:
                self.pace_s = max(0.0, self._clock() - begin - self._newly_slow_s)

    def _restart(self) -> None:
        """Forget NVML's state (handles die with a driver reload): the next sweep starts it."""
        self._initialized = False
        self._failure = None
        self._next_attempt = float("-inf")
        self._handles.clear()
        self._static.clear()
        self._mig_mode.clear()
        self._minor.clear()
        self._no_aggregate.clear()
        self._util_seen.clear()
        self._energy.clear()
        self._pcie.clear()
        self._gpm_supported.clear()
        # Dropped, not freed: after a driver reload NVML answers UNINITIALIZED, and whether a sample
        # from before may be freed after the next init is not documented (one small leak a reload).
        self._gpm_sample.clear()
        self._unsupported.clear()

    def _sample_devices(self) -> tuple[GpuStatus, tuple[GpuDevice, ...]]:
        """Every device's reading (NVML is up)."""
        count = self._query("nvmlDeviceGetCount")
        if self.last_error in _RESTART_KINDS:
            raise _Restart
        if count is NA:
            kind = self.last_error.value if self.last_error else "unknown error"
            return GpuStatus(
                available=False,
                reason=f"NVML could not count the GPUs ({kind}).",
                driver_version=self._driver_version,
            ), ()
        count = int(count)
        for index in [i for i in self._handles if i >= count]:
            self._forget(index)
        if count == 0:
            return GpuStatus(
                available=False,
                reason="NVML sees no NVIDIA GPU on this machine.",
                driver_version=self._driver_version,
            ), ()
        devices = tuple(d for index in range(count) for d in self._timed_device(index))
        if self._host_pids:
            return GpuStatus(available=True, driver_version=self._driver_version), devices
        devices = tuple(_unattributed(d) for d in devices)
        return GpuStatus(
            available=True, driver_version=self._driver_version, process_memory_note=CONTAINER_PIDS_NOTE
        ), devices

    def close(self) -> None:
        """Shut NVML down if this collector started it. A later :meth:`sample` starts it again."""
        with self._lock:
            if self._initialized:
                for index in list(self._gpm_sample):
                    self._free_gpm(index)
                self._query("nvmlShutdown")
            self._restart()
            self._last_reading.clear()
            self._backoff.clear()

    def __enter__(self) -> GpuCollector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- initialisation ------------------------------------------------------------------------

    def _ensure_initialized(self) -> GpuStatus | None:
        """None when NVML is up; else the (cached) status saying why not."""
        if self._initialized:
            return None
        now = self._clock()
        if self._failure is not None and now < self._next_attempt:
            return self._failure
        self._failure = self._try_initialize()
        if self._failure is not None:
            self._next_attempt = now + self._retry_interval_s
            return self._failure
        return None

    def _try_initialize(self) -> GpuStatus | None:
        if self._lib is None:
            try:
                import pynvml
            except ImportError:
                return GpuStatus(available=False, reason="NVML not available: nvidia-ml-py not installed")
            except Exception as error:  # a broken install must not take the monitor down
                return GpuStatus(
                    available=False, reason=f"NVML not available: importing pynvml failed ({error!r})."
                )
            self._lib = pynvml
        self._bind_error_classes()
        init = getattr(self._lib, "nvmlInit", None)
        if not callable(init):
            return GpuStatus(
                available=False, reason="NVML not available: the installed pynvml has no nvmlInit."
            )
        try:
            init()
        except Exception as error:  # init must never raise out of sample(); see the reasons
            kind = self._classify(error) or NVMLErrorKind.OTHER
            return GpuStatus(available=False, reason=_init_failure_reason(kind, error))
        self._initialized = True
        self._driver_version = _str_or_none(self._query("nvmlSystemGetDriverVersion"))
        self._check_process_struct()
        return None

    def _check_process_struct(self) -> None:
        """nvidia-ml-py 12.535.77 declares a 32-byte ``_v3`` process struct that drivers fill
        with 24-byte entries: every entry after the first is misread (garbage pids). With such
        bindings the _v3 lists are not called; the _v2 ones use the driver's 24-byte layout."""
        struct = getattr(self._lib, "c_nvmlProcessInfo_v3_t", None)
        try:
            size = ctypes.sizeof(struct) if struct is not None else DRIVER_PROCESS_INFO_BYTES
        except TypeError:  # not a ctypes type: a stand-in library, nothing to check
            return
        if size != DRIVER_PROCESS_INFO_BYTES:
            self._missing.update(variants[0] for variants in _PROCESS_LISTS)

    def _bind_error_classes(self) -> None:
        kinds: list[tuple[type[BaseException], NVMLErrorKind]] = []
        for name, kind in _ERROR_CLASSES:
            cls = getattr(self._lib, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                kinds.append((cls, kind))
        self._error_kinds = tuple(kinds)
        base = getattr(self._lib, "NVMLError", None)
        self._nvml_error = base if isinstance(base, type) and issubclass(base, BaseException) else None
        mismatch = getattr(self._lib, "NVMLLibraryMismatchError", None)
        is_exc = isinstance(mismatch, type) and issubclass(mismatch, BaseException)
        self._mismatch_error = mismatch if is_exc else None

    def _classify(self, error: BaseException) -> NVMLErrorKind | None:
        """The kind of an NVML error, or None when ``error`` is not one."""
        for cls, kind in self._error_kinds:
            if isinstance(error, cls):
                return kind
        if self._mismatch_error is not None and isinstance(error, self._mismatch_error):
            return NVMLErrorKind.FUNCTION_NOT_FOUND
        if self._nvml_error is not None and isinstance(error, self._nvml_error):
            return NVMLErrorKind.OTHER
        return None

    # -- the choke point -----------------------------------------------------------------------

    def _query(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``library.<name>(*args)``; :data:`NA` instead of an NVML error or a missing name.

        Bytes results are decoded. Exceptions that are not NVML's propagate: they are bugs.
        """
        self.last_error = None
        self.last_exception = None
        if name in self._missing:
            self.last_error = NVMLErrorKind.FUNCTION_NOT_FOUND
            return NA
        function = getattr(self._lib, name, None)
        if not callable(function):
            self._missing.add(name)
            self.last_error = NVMLErrorKind.FUNCTION_NOT_FOUND
            return NA
        try:
            result = function(*args, **kwargs)
        except UnicodeDecodeError as error:  # pynvml decodes C strings itself
            self.last_error = NVMLErrorKind.UNKNOWN
            self.last_exception = error
            return NA
        except Exception as error:
            kind = self._classify(error)
            if kind is None:
                raise
            if kind is NVMLErrorKind.FUNCTION_NOT_FOUND:
                self._missing.add(name)
            self.last_error = kind
            self.last_exception = error
            return NA
        return _decode(result)

    def _device_query(self, index: int, name: str, *args: Any, **kwargs: Any) -> Any:
        """:meth:`_query` for one device: a lost GPU ends that device's reading."""
        result = self._query(name, *args, **kwargs)
        if self.last_error in _RESTART_KINDS:
            raise _Restart
        if self.last_error is not None and self.last_error is not NVMLErrorKind.FUNCTION_NOT_FOUND:
            # a fallback may still answer: the error then explains nothing (see _with_reason)
            self._device_errors.append((self._figure, self.last_error, self._error_words()))
        if self.last_error is NVMLErrorKind.GPU_IS_LOST:
            self._forget(index)
            raise _DeviceLost
        return result

    def _error_words(self) -> str:
        """What to say of the last error: its kind, or NVML's own words for one without a kind of
        its own (``Timeout``, ``Insufficient Resources``, ...), rather than "other NVML error"."""
        kind = self.last_error
        if kind is NVMLErrorKind.OTHER and self.last_exception is not None:
            return str(self.last_exception).strip() or kind.value
        return kind.value if kind is not None else ""

    def _check_slow(self) -> None:
        """Raise :class:`_DeviceSlow` once the device being read has taken ``slow_device_s``:
        its other calls would likely block as long (a sweep then costs one hang, not six)."""
        if self._slow_device_s is not None and self._clock() - self._device_start > self._slow_device_s:
            raise _DeviceSlow

    # -- per device ----------------------------------------------------------------------------

    def _forget(self, index: int) -> None:
        self._handles.pop(index, None)
        self._static.pop(index, None)
        self._mig_mode.pop(index, None)
        self._minor.pop(index, None)
        self._no_aggregate.discard(index)
        self._util_seen.pop(index, None)
        self._energy.pop(index, None)
        self._pcie.pop(index, None)
        self._gpm_supported.pop(index, None)
        self._free_gpm(index)  # the next handle at this index may be another GPU
        self._unsupported -= {key for key in self._unsupported if key[0] == index}
        self._last_reading.pop(index, None)
        self._backoff.pop(index, None)

    def _timed_device(self, index: int) -> tuple[GpuDevice, ...]:
        """:meth:`_sample_device`, unless the device is backed off: then its last reading, stale."""
        now = self._clock()
        backoff = self._backoff.get(index)
        last = self._last_reading.get(index)
        if backoff is not None and now < backoff[0] and last is not None:
            age = round(now - last[1], 3)
            return tuple(dataclasses.replace(d, stale_age_s=age) for d in last[0])
        self._device_start = now
        device = self._sample_device(index)
        end = self._clock()
        self._last_reading[index] = (device, end)
        if self._slow_device_s is not None and end - now > self._slow_device_s:
            wait = (
                FIRST_BACKOFF_S
                if backoff is None
                else max(FIRST_BACKOFF_S, min(2 * backoff[1], MAX_BACKOFF_S))
            )
            self._backoff[index] = (end + wait, wait)
            self._newly_slow_s += end - now
        elif backoff is not None and backoff[1] / 2 >= FIRST_BACKOFF_S:
            self._backoff[index] = (end, backoff[1] / 2)  # one fast read does not undo a long hang
        else:
            self._backoff.pop(index, None)
        return device

    def _sample_device(self, index: int) -> tuple[GpuDevice, ...]:
        """The card, then its MIG devices when it is in MIG mode."""
        self._device_errors = []
        self._figure = "name"
        device, *migs = self._read_device(index)
        return (self._with_reason(device), *migs)

    def _with_reason(self, device: GpuDevice) -> GpuDevice:
        """``device`` with why the figures it should have and lacks are missing: the errors of
        those figures' queries, not the first error of the read (a call whose fallback answered
        explains nothing). A card in MIG mode has no utilisation (NVML does not report it) and
        its memory only for the privileged: those are said by its MIG mode, not as an error."""
        expected: dict[str, object] = {"name": device.name}
        if not device.is_mig_parent:
            expected["memory"] = device.memory_used_bytes
        if device.mig_mode is None:
            expected["utilisation"] = device.utilization_percent
        missing = {figure for figure, value in expected.items() if value is None}
        if any(words == MISREAD_PROCESSES for _, _, words in self._device_errors):
            missing.add("processes")  # the list is there, with entries left out
        if not missing:
            return device
        lost = [words for _, kind, words in self._device_errors if kind is NVMLErrorKind.GPU_IS_LOST]
        said = lost or [words for figure, _, words in self._device_errors if figure in missing]
        if not said:
            return device
        return dataclasses.replace(device, unavailable_reason="NVML: " + "; ".join(dict.fromkeys(said)))

    def _quiet(self, index: int, name: str, *args: Any) -> Any:
        """:meth:`_device_query` for an answer that may well be an error (not MIG capable, an
        empty MIG slot, a MIG card's aggregate figures): the error is not the device's trouble."""
        errors = len(self._device_errors)
        result = self._device_query(index, name, *args)
        del self._device_errors[errors:]
        return result

    def _in_mig_mode(self, index: int, handle: Any) -> bool:
        known = self._mig_mode.get(index)
        if known is not None:
            return known
        mode = self._quiet(index, "nvmlDeviceGetMigMode", handle)
        if mode is NA and self.last_error not in (
            NVMLErrorKind.NOT_SUPPORTED,
            NVMLErrorKind.FUNCTION_NOT_FOUND,
        ):
            return False  # not known this time: asked again next sweep
        try:
            on = mode is not NA and int(mode[0]) == MIG_ENABLE
        except (TypeError, ValueError, IndexError):
            on = False
        self._mig_mode[index] = on
        return on

    def _read_device(self, index: int) -> tuple[GpuDevice, ...]:
        static: tuple[str | None, str | None] = (None, None)
        used = total = None
        utilization = None
        processes: tuple[GpuProcess, ...] = ()
        power: float | None = None
        events: tuple[str, ...] = ()
        pcie: dict[int, float] = {}
        gpm: tuple[float | None, float | None] = (None, None)
        mig: bool | None = None
        migs: list[GpuDevice] = []
        try:
            handle = self._handles.get(index)
            if handle is None:
                handle = self._device_query(index, "nvmlDeviceGetHandleByIndex", index)
                if handle is NA:
                    return (GpuDevice(index, None, None, None, None, None),)
                self._handles[index] = handle
                self._check_slow()
            cached = self._static.get(index)
            if cached is None:
                name = _str_or_none(self._device_query(index, "nvmlDeviceGetName", handle))
                static = (name, None)
                self._check_slow()
                uuid = _str_or_none(self._device_query(index, "nvmlDeviceGetUUID", handle))
                static = (name, uuid)
                if name is not None and uuid is not None:
                    self._static[index] = static
                self._check_slow()
            else:
                static = cached
            if index not in self._minor:
                minor = self._quiet(index, "nvmlDeviceGetMinorNumber", handle)
                ok = minor is not NA and not isinstance(minor, bool) and isinstance(minor, int)
                self._minor[index] = minor if ok else None
            mig = self._in_mig_mode(index, handle) or None
            self._check_slow()
            self._figure = "memory"
            if mig:
                # The card's own figures are aggregates only the privileged may read, and its
                # utilisation is not reported: the MIG devices are read instead, as devices.
                if index not in self._no_aggregate:
                    errors = len(self._device_errors)
                    used, total = self._memory(index, handle)
                    if self.last_error is NVMLErrorKind.NO_PERMISSION:
                        self._no_aggregate.add(index)
                    del self._device_errors[errors:]
                self._mig_devices(index, handle, migs)
            else:
                used, total = self._memory(index, handle)
                self._check_slow()
                self._figure = "utilisation"
                utilization = self._utilization(index, handle)
                self._check_slow()
                self._figure = "processes"
                processes = self._processes(index, handle)
                self._check_slow()
                processes = self._with_sm_util(index, handle, processes)
                self._check_slow()
                power = self._power(index, handle)
                self._check_slow()
                events = self._clock_events(index, handle)
                self._check_slow()
                pcie = self._pcie_rates(index, handle)
                self._check_slow()
                gpm = self._gpm_metrics(index, handle)
        except _DeviceLost:
            return (GpuDevice(index, None, None, None, None, None),)
        except _DeviceSlow:  # what it answered so far; the rest is not asked for
            partial = GpuDevice(
                index,
                static[0],
                static[1],
                used,
                total,
                utilization,
                processes,  # a list read in full is kept: the extras after it were the slow part
                unavailable_reason=SLOW_REASON,
                mig_mode=mig,
                minor_number=self._minor.get(index),
            )
            return (partial, *migs)
        card = GpuDevice(
            index=index,
            name=static[0],
            uuid=static[1],
            memory_used_bytes=used,
            memory_total_bytes=total,
            utilization_percent=utilization,
            processes=processes,
            mig_mode=mig,
            minor_number=self._minor.get(index),
            power_w=power,
            clock_events=events,
            pcie_rx_bytes_per_s=pcie.get(PCIE_RX_FIELD),
            pcie_tx_bytes_per_s=pcie.get(PCIE_TX_FIELD),
            sm_active_percent=gpm[0],
            sm_occupancy_percent=gpm[1],
        )
        return (card, *migs)

    def _mig_devices(self, index: int, handle: Any, out: list[GpuDevice]) -> None:
        """Append each MIG device of card ``index`` to ``out`` (slots may be empty)."""
        slots = self._quiet(index, "nvmlDeviceGetMaxMigDeviceCount", handle)
        if slots is NA or isinstance(slots, bool):
            return
        slot = -1
        try:
            for slot in range(max(0, min(int(slots), MAX_MIG_SLOTS))):
                self._check_slow()
                mig = self._quiet(index, "nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
                if mig is NA:
                    continue  # NVML_ERROR_NOT_FOUND: no MIG device in this slot
                out.append(self._mig_device(index, mig, slot))
        except _DeviceSlow:
            # The card's read stops here, as a whole card's does; its MIG devices not read stay
            # on the panel, n/a and saying why, rather than vanish (with their alerts and series).
            out.extend(self._unread_migs(index, slot, {d.mig_index for d in out}))
            raise

    def _mig_device(self, index: int, mig: Any, slot: int) -> GpuDevice:
        """One MIG device of card ``index``; on :class:`_DeviceSlow`, what it answered so far is
        left in ``_partial_mig`` for :meth:`_unread_migs`."""
        card_errors, self._device_errors = self._device_errors, []
        name = uuid = used = total = None
        try:
            self._figure = "name"
            name = _str_or_none(self._device_query(index, "nvmlDeviceGetName", mig))
            uuid = _str_or_none(self._device_query(index, "nvmlDeviceGetUUID", mig))
            self._figure = "memory"
            used, total = self._memory(index, mig)
            self._check_slow()
            self._figure = "processes"
            processes = self._processes(index, mig)
            device = GpuDevice(index, name, uuid, used, total, None, processes, mig_index=slot, mig_mode=True)
            return self._with_reason(device)
        except _DeviceSlow:
            self._partial_mig = GpuDevice(
                index,
                name,
                uuid,
                used,
                total,
                None,
                mig_index=slot,
                mig_mode=True,
                unavailable_reason=SLOW_REASON,
            )
            raise
        finally:
            self._device_errors = card_errors

    def _unread_migs(self, index: int, slot: int, read: set[int | None]) -> list[GpuDevice]:
        """Card ``index``'s MIG devices from ``slot`` on, its read cut short there: the one being
        read with what it answered, the others as the last reading knew them, figures n/a."""
        out: list[GpuDevice] = []
        partial, self._partial_mig = self._partial_mig, None
        if partial is not None and partial.mig_index == slot:
            out.append(partial)
            read = read | {slot}
        last = self._last_reading.get(index)
        for d in last[0] if last is not None else ():
            if d.mig_index is not None and d.mig_index >= slot and d.mig_index not in read:
                out.append(
                    GpuDevice(
                        index,
                        d.name,
                        d.uuid,
                        None,
                        None,
                        None,
                        mig_index=d.mig_index,
                        mig_mode=True,
                        unavailable_reason=SLOW_REASON,
                    )
                )
        return out

    def _memory(self, index: int, handle: Any) -> tuple[int | None, int | None]:
        """(used, total) bytes. The v2 struct's ``used`` leaves out memory the driver reserves,
        as recent nvidia-smi does; v1's ``used`` includes it."""
        info: Any = NA
        if self._memory_v2 is not False:
            version = getattr(self._lib, "nvmlMemory_v2", None)
            if version is None:
                self._memory_v2 = False
            else:
                try:
                    info = self._device_query(index, "nvmlDeviceGetMemoryInfo", handle, version=version)
                except TypeError:  # a pynvml whose nvmlDeviceGetMemoryInfo takes no version
                    info = NA
                    self._memory_v2 = False
                else:
                    if self.last_error is NVMLErrorKind.FUNCTION_NOT_FOUND:
                        # The driver has no nvmlDeviceGetMemoryInfo_v2; the v1 call may still work.
                        self._missing.discard("nvmlDeviceGetMemoryInfo")
                        self._memory_v2 = False
                    elif info is not NA:
                        self._memory_v2 = True
        if info is NA and self._memory_v2 is not True:
            # No v2, or v2 has not answered yet: v1 may. Once v2 has worked, v1 is not mixed in,
            # as its ``used`` counts the reserved memory too and the series would jump.
            info = self._device_query(index, "nvmlDeviceGetMemoryInfo", handle)
        if info is NA:
            return None, None
        return _bytes_or_none(getattr(info, "used", None)), _bytes_or_none(getattr(info, "total", None))

    def _utilization(self, index: int, handle: Any) -> float | None:
        rates = self._device_query(index, "nvmlDeviceGetUtilizationRates", handle)
        if rates is NA:
            return None
        gpu = getattr(rates, "gpu", None)
        if gpu is None or isinstance(gpu, bool):
            return None
        try:
            percent = float(gpu)
        except (TypeError, ValueError):
            return None
        return percent if 0.0 <= percent <= 100.0 else None

    def _processes(self, index: int, handle: Any) -> tuple[GpuProcess, ...]:
        """Compute, graphics and MPS processes merged by pid.

        Within one listing the same pid can appear once per MIG instance: those are summed.
        Across listings a pid with both a compute and a graphics context is reported with the
        same figure in each: the larger known one is kept.
        """
        merged: dict[int, int | None] = {}
        for number, variants in enumerate(_PROCESS_LISTS):
            if number:
                self._check_slow()  # between listings too: each is two calls
            listing = self._process_listing(index, handle, variants)
            per_pid: dict[int, int | None] = {}
            for entry in listing:
                pid = getattr(entry, "pid", None)
                if pid is None or isinstance(pid, bool):
                    continue
                try:
                    pid = int(pid)
                except (TypeError, ValueError):
                    continue
                if not 0 < pid <= PID_MAX_LIMIT:
                    # A misread entry (bindings and driver disagree on the struct), never
                    # anybody's process: shown, it would be an "other" process holding VRAM.
                    self._device_errors.append(("processes", NVMLErrorKind.OTHER, MISREAD_PROCESSES))
                    continue
                used = _bytes_or_none(getattr(entry, "usedGpuMemory", None))
                if pid in per_pid:
                    previous = per_pid[pid]
                    per_pid[pid] = None if previous is None or used is None else previous + used
                else:
                    per_pid[pid] = used
            for pid, used in per_pid.items():
                if pid not in merged:
                    merged[pid] = used
                else:
                    known = [v for v in (merged[pid], used) if v is not None]
                    merged[pid] = max(known) if known else None
        return tuple(GpuProcess(pid, merged[pid]) for pid in sorted(merged))

    def _with_sm_util(
        self, index: int, handle: Any, processes: tuple[GpuProcess, ...]
    ) -> tuple[GpuProcess, ...]:
        """``processes`` with NVML's per-process SM utilisation over the samples newer than the
        newest seen on this device, looking back at least FIRST_UTIL_LOOKBACK_US (NVML keeps a
        buffer; asking from 0 would average over all of it; asking only since the last sweep can
        find no new sample when sweeps are faster than NVML's sampling).

        NVML returns a sample only for a process with non-zero utilisation in that period: a
        listed process without one ran no kernel then, so it counts 0 in every period where
        another process has a sample, and 0 when NOT_FOUND says no process had any (a starved
        trainer beside a colleague's busy job is idle, not unknown). NOT_SUPPORTED and other
        errors leave None."""
        if not processes:
            return processes
        floor = max(0, int(time.time() * 1e6) - FIRST_UTIL_LOOKBACK_US)
        seen = self._util_seen.get(index)
        since = floor if seen is None else min(seen, floor)
        samples = self._extra(index, "nvmlDeviceGetProcessUtilization", handle, since)
        if samples is NA:
            if self.last_error is NVMLErrorKind.NOT_FOUND:
                return tuple(dataclasses.replace(p, sm_percent=0.0) for p in processes)
            return processes
        per_pid: dict[int, float] = {}
        stamps: set[int] = set()
        newest = seen if seen is not None else since
        try:
            for sample in samples:
                stamp, pid, sm = int(sample.timeStamp), int(sample.pid), int(sample.smUtil)
                if stamp <= since or not 0 <= sm <= 100:
                    continue  # an old sample, or a value NVML does not give
                newest = max(newest, stamp)
                stamps.add(stamp)
                per_pid[pid] = per_pid.get(pid, 0.0) + float(sm)
        except (TypeError, ValueError, AttributeError):
            return processes
        self._util_seen[index] = newest
        if not stamps:
            return tuple(dataclasses.replace(p, sm_percent=0.0) for p in processes)
        periods = len(stamps)  # the sampling periods in which some process ran a kernel
        return tuple(
            dataclasses.replace(p, sm_percent=round(min(100.0, per_pid.get(p.pid, 0.0) / periods), 1))
            for p in processes
        )

    def _extra(self, index: int, name: str, *args: Any) -> Any:
        """:meth:`_quiet` for a figure beyond the device's own (per-process utilisation, energy,
        clock reasons): a device that does not support it is not asked again."""
        if (index, name) in self._unsupported:
            self.last_error = NVMLErrorKind.NOT_SUPPORTED
            return NA
        result = self._quiet(index, name, *args)
        if self.last_error is NVMLErrorKind.NOT_SUPPORTED:
            self._unsupported.add((index, name))
        return result

    def _power(self, index: int, handle: Any) -> float | None:
        """Mean watts since the previous sweep, from the energy counter (mJ since the driver
        loaded): a delta, not nvmlDeviceGetPowerUsage's instant reading."""
        energy = self._extra(index, "nvmlDeviceGetTotalEnergyConsumption", handle)
        now = self._clock()
        if energy is NA or isinstance(energy, bool) or not isinstance(energy, int):
            self._energy.pop(index, None)
            return None
        last = self._energy.get(index)
        self._energy[index] = (energy, now)
        if last is None or now <= last[1] or energy < last[0]:
            return None  # the first reading, or a counter that went back (a driver reload)
        return round((energy - last[0]) / 1000.0 / (now - last[1]), 1)

    def _clock_events(self, index: int, handle: Any) -> tuple[str, ...]:
        reasons = self._extra(index, "nvmlDeviceGetCurrentClocksEventReasons", handle)
        if reasons is NA and self.last_error is NVMLErrorKind.FUNCTION_NOT_FOUND:
            reasons = self._extra(index, "nvmlDeviceGetCurrentClocksThrottleReasons", handle)  # drivers < 535
        if reasons is NA or isinstance(reasons, bool) or not isinstance(reasons, int):
            return ()
        return tuple(name for bit, name in CLOCK_EVENTS if reasons & bit)

    def _pcie_rates(self, index: int, handle: Any) -> dict[int, float]:
        """Field id -> bytes/s since the previous sweep, from the PCIe byte counters and the
        timestamps NVML gives with them (none at the first sweep, or after a counter reset)."""
        values = self._extra(index, "nvmlDeviceGetFieldValues", handle, [PCIE_RX_FIELD, PCIE_TX_FIELD])
        if values is NA:
            return {}
        last = self._pcie.get(index, {})
        now: dict[int, tuple[int, int]] = {}
        rates: dict[int, float] = {}
        try:
            answers = [int(value.nvmlReturn) for value in values]
            if answers and all(answer == NVML_NOT_SUPPORTED for answer in answers):
                self._unsupported.add((index, "nvmlDeviceGetFieldValues"))  # not asked again
                return {}
            for value in values:
                member = PCIE_COUNTER_MEMBERS.get(int(value.valueType))
                if int(value.nvmlReturn) != 0 or member is None:
                    continue  # this counter is not supported here, or too narrow to rate
                field, stamp = int(value.fieldId), int(value.timestamp)
                count = int(getattr(value.value, member))
                now[field] = (count, stamp)
                before = last.get(field)
                if before is not None and stamp > before[1] and count >= before[0]:
                    rates[field] = round((count - before[0]) * 1e6 / (stamp - before[1]), 1)
        except (TypeError, ValueError, AttributeError):
            return {}
        self._pcie[index] = now
        return rates

    def _gpm_metrics(self, index: int, handle: Any) -> tuple[float | None, float | None]:
        """(SM busy %, SM occupancy %) between this sweep's GPM sample and the last one's, on a
        device that supports GPM (asked once); (None, None) at the first sweep or on any error.
        One sample is kept per device: the newest, freed when the next one has been used."""
        supported = self._gpm_supported.get(index)
        if supported is None:
            support = self._extra(index, "nvmlGpmQueryDeviceSupport", handle)
            supported = support is not NA and bool(getattr(support, "isSupportedDevice", 0))
            if support is not NA or self.last_error in _NOT_THERE:
                self._gpm_supported[index] = supported  # else asked again: no answer yet
        request_type = getattr(self._lib, "c_nvmlGpmMetricsGet_t", None)
        if not supported or request_type is None:
            return None, None
        sample = self._extra(index, "nvmlGpmSampleAlloc")
        if sample is NA:
            return None, None
        try:
            taken = self._extra(index, "nvmlGpmSampleGet", handle, sample)
        except (_DeviceLost, _Restart):
            self._free_sample(sample)  # held nowhere yet: freed here or leaked
            raise
        if taken is NA:
            self._free_sample(sample)
            return None, None
        previous = self._gpm_sample.get(index)
        self._gpm_sample[index] = sample
        if previous is None:
            return None, None
        try:
            return self._gpm_between(index, request_type, previous, sample)
        finally:
            self._free_sample(previous)

    def _gpm_between(
        self, index: int, request_type: Any, first: Any, second: Any
    ) -> tuple[float | None, float | None]:
        try:
            request = request_type()
            request.version = GPM_METRICS_GET_VERSION
            request.numMetrics = 2
            request.sample1, request.sample2 = first, second
            request.metrics[0].metricId = GPM_SM_UTIL
            request.metrics[1].metricId = GPM_SM_OCCUPANCY
        except (TypeError, AttributeError, IndexError):
            return None, None
        if self._extra(index, "nvmlGpmMetricsGet", request) is NA:
            return None, None
        out: list[float | None] = []
        for metric in request.metrics[:2]:
            value = float(metric.value) if int(metric.nvmlReturn) == 0 else None
            out.append(round(value, 1) if value is not None and 0.0 <= value <= 100.0 else None)
        return out[0], out[1]

    def _free_gpm(self, index: int) -> None:
        """Free the device's held GPM sample. A plain query: an error freeing it (a GPU lost, a
        driver gone) must neither recurse into :meth:`_forget` nor raise out of :meth:`close`."""
        sample = self._gpm_sample.pop(index, None)
        if sample is not None and self._initialized:
            self._free_sample(sample)

    def _free_sample(self, sample: Any) -> None:
        """nvmlGpmSampleFree, leaving :attr:`last_error` to the query that led here (a restart's
        reason, a lost GPU)."""
        error, exception = self.last_error, self.last_exception
        self._query("nvmlGpmSampleFree", sample)
        self.last_error, self.last_exception = error, exception

    def _process_listing(self, index: int, handle: Any, variants: Iterable[str]) -> list[Any]:
        """The first variant whose function exists; an empty list when none answers."""
        for name in variants:
            result = self._device_query(index, name, handle)
            if result is NA:
                if self.last_error is NVMLErrorKind.FUNCTION_NOT_FOUND:
                    continue  # remembered in _missing: the next sample goes straight on
                return []
            try:
                return list(result)
            except TypeError:
                return []
        return []
