"""A fake pynvml for dlmon.collect.gpu, at the one seam (the module GpuCollector is given): devices,
their process lists in each API version, errors by name, and a count of the calls made."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


class NVMLError(Exception):
    value = 999

    def __str__(self) -> str:
        return type(self).__name__.removeprefix("NVMLError_")


class NVMLError_NotSupported(NVMLError):
    value = 3


class NVMLError_NoPermission(NVMLError):
    value = 4


class NVMLError_NotFound(NVMLError):
    value = 6


class NVMLError_DriverNotLoaded(NVMLError):
    value = 9


class NVMLError_Timeout(NVMLError):
    value = 10


class NVMLError_LibraryNotFound(NVMLError):
    value = 12


class NVMLError_FunctionNotFound(NVMLError):
    value = 13


class NVMLError_GpuIsLost(NVMLError):
    value = 15


class NVMLError_Unknown(NVMLError):
    value = 999


class NVMLLibraryMismatchError(Exception):
    """pynvml's unversioned dispatchers raise this (not an NVMLError) for a missing symbol."""


ERRORS = {
    cls.__name__: cls
    for cls in (
        NVMLError,
        NVMLError_NotSupported,
        NVMLError_NoPermission,
        NVMLError_NotFound,
        NVMLError_DriverNotLoaded,
        NVMLError_Timeout,
        NVMLError_LibraryNotFound,
        NVMLError_FunctionNotFound,
        NVMLError_GpuIsLost,
        NVMLError_Unknown,
        NVMLLibraryMismatchError,
    )
}
CODES = {f"NVML_ERROR_{n}": c for n, c in [("NOT_SUPPORTED", 3), ("GPU_IS_LOST", 15), ("UNKNOWN", 999)]}

MEMORY_V2 = 0x02000028
COMPUTE = "nvmlDeviceGetComputeRunningProcesses"
GRAPHICS = "nvmlDeviceGetGraphicsRunningProcesses"


@dataclass
class Dev:
    name: str | bytes = "NVIDIA H200"
    uuid: str | bytes = "GPU-0"
    used: int = 10 * GiB  # as the v2 struct counts it: reserved memory left out
    reserved: int = 512 * MiB
    total: int = 140 * GiB
    util: int = 37
    compute: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    fail: dict[str, type[Exception]] = field(default_factory=dict)  # function name -> raised


@dataclass(frozen=True)
class Handle:
    index: int


class FakeNVML:
    """Just enough of pynvml. ``absent`` names are not attributes (an old pynvml); ``no_symbol``
    names are attributes that raise FunctionNotFound (a driver without that symbol)."""

    def __init__(
        self,
        devices: list[Dev],
        *,
        absent: tuple[str, ...] = (),
        no_symbol: tuple[str, ...] = (),
        init_error: type[Exception] | None = None,
        memory_v2_error: type[Exception] | None = None,
        driver: str | bytes = "580.159.04",
    ) -> None:
        self.devices = devices
        self.no_symbol = set(no_symbol)
        self.init_error = init_error
        self.memory_v2_error = memory_v2_error
        self.driver = driver
        self.calls: list[str] = []
        for name, value in {**ERRORS, **CODES, "nvmlMemory_v2": MEMORY_V2}.items():
            if name not in absent:
                setattr(self, name, value)
        functions = {
            "nvmlInit": self._init,
            "nvmlShutdown": lambda: None,
            "nvmlSystemGetDriverVersion": lambda: self.driver,
            "nvmlDeviceGetCount": lambda: len(self.devices),
            "nvmlDeviceGetHandleByIndex": Handle,
            "nvmlDeviceGetName": lambda h: self._dev(h).name,
            "nvmlDeviceGetUUID": lambda h: self._dev(h).uuid,
            "nvmlDeviceGetMemoryInfo": self._memory,
            "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=self._dev(h).util, memory=5),
        }
        for kind in (COMPUTE, GRAPHICS):
            for suffix in ("_v3", "_v2", ""):
                functions[kind + suffix] = self._lister(kind, suffix)
        for name, function in functions.items():
            if name not in absent:
                setattr(self, name, self._recorded(name, function))

    def _recorded(self, name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if args and isinstance(args[0], Handle) and name in self._dev(args[0]).fail:
                raise self._dev(args[0]).fail[name]()
            return function(*args, **kwargs)

        return call

    def _dev(self, handle: Handle) -> Dev:
        return self.devices[handle.index]

    def _init(self) -> None:
        if self.init_error is not None:
            raise self.init_error()

    def _memory(self, handle: Handle, version: int | None = None) -> SimpleNamespace:
        d = self._dev(handle)
        if version:
            if "nvmlDeviceGetMemoryInfo_v2" in self.no_symbol:
                raise NVMLError_FunctionNotFound()
            if self.memory_v2_error is not None:
                raise self.memory_v2_error()
            assert version == MEMORY_V2
            return SimpleNamespace(version=version, total=d.total, reserved=d.reserved, used=d.used)
        return SimpleNamespace(total=d.total, free=d.total - d.used - d.reserved, used=d.used + d.reserved)

    def _lister(self, kind: str, suffix: str) -> Any:
        def listing(handle: Handle) -> list[SimpleNamespace]:
            if kind + suffix in self.no_symbol:
                if suffix == "":
                    raise NVMLLibraryMismatchError()
                raise NVMLError_FunctionNotFound()
            entries = self._dev(handle).compute if kind == COMPUTE else self._dev(handle).graphics
            return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in entries]

        return listing

    def count(self, name: str) -> int:
        return self.calls.count(name)


def two_devices() -> list[Dev]:
    return [
        Dev(
            name="NVIDIA H200",
            uuid="GPU-aaaa",
            used=20 * GiB,
            util=81,
            compute=[(4242, 18 * GiB), (4300, 1 * GiB)],
            graphics=[(4242, 18 * GiB), (77, 64 * MiB)],
        ),
        Dev(name="NVIDIA H200", uuid="GPU-bbbb", used=3 * GiB, util=0, compute=[(4343, 2 * GiB)]),
    ]
