"""The GPU's clocks, temperature, power and clock event reasons while a row is timed.

Read through NVML (``cuda.bindings.nvml``, where the installed cuda-bindings carries it) after
each timed burst, outside the timed window, so that a row that reads slower than its neighbours
can be told apart from a device that slowed down (a power cap, a thermal slowdown, a lower clock)
during it. Without NVML the benchmark runs as before and records why it has no readings.
"""

from __future__ import annotations

# NVML's clock event reason bits (nvmlClocksEventReason*, nvml.h), the ones that slow a device.
# GPU idle (0x1) is left out: every reading between bursts may catch it.
SLOWDOWN_REASONS = {
    0x2: "applications clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}


class DeviceMonitor:
    """One NVML device handle; :meth:`read` returns what it could read of the device's state."""

    def __init__(self, nvml, handle) -> None:
        self._nvml = nvml
        self._handle = handle

    @classmethod
    def open(cls, cp, ordinal: int, nvml=None) -> tuple["DeviceMonitor | None", str]:
        """The monitor of CUDA device ``ordinal`` (found by its PCI bus id, so that
        CUDA_VISIBLE_DEVICES cannot point it at another GPU), or None and the reason. ``nvml``:
        the bindings module (default ``cuda.bindings.nvml``)."""
        if nvml is None:
            try:
                from cuda.bindings import nvml
            except ImportError as exc:
                return None, f"unavailable (cuda.bindings.nvml: {exc})"
        try:
            nvml.init_v2()
            bus_id = cp.cuda.runtime.deviceGetPCIBusId(ordinal)
            handle = nvml.device_get_handle_by_pci_bus_id_v2(bus_id)
            monitor = cls(nvml, handle)
            if not monitor.read():
                return None, "unavailable (NVML answered no field)"
            return monitor, "NVML"
        except Exception as exc:  # noqa: BLE001 - a benchmark without readings still runs
            return None, f"unavailable ({type(exc).__name__}: {exc})"[:200]

    def read(self) -> dict:
        """SM and memory clocks (MHz), GPU temperature (C), power (W) and the clock event reasons
        bitmask; a field NVML does not answer is left out."""
        nvml, h = self._nvml, self._handle
        fields = {
            "sm_mhz": lambda: nvml.device_get_clock_info(h, nvml.ClockType.CLOCK_SM),
            "mem_mhz": lambda: nvml.device_get_clock_info(h, nvml.ClockType.CLOCK_MEM),
            "gpu_c": lambda: nvml.device_get_temperature_v(h, nvml.TemperatureSensors.TEMPERATURE_GPU),
            "power_w": lambda: nvml.device_get_power_usage(h) / 1000.0,
            "reasons": lambda: nvml.device_get_current_clocks_event_reasons(h),
        }
        out = {}
        for name, get in fields.items():
            try:
                out[name] = get()
            except Exception:  # noqa: BLE001 - a field this driver or binding does not answer
                continue
        return out


def summarize(readings: list[dict]) -> dict:
    """The range of each field over a row's readings and every slowdown reason seen in any."""
    out: dict = {"readings": len(readings)}
    for name in ("sm_mhz", "mem_mhz", "gpu_c", "power_w"):
        values = [r[name] for r in readings if r.get(name) is not None]
        if values:
            out[name] = [min(values), max(values)]
    seen = 0
    for r in readings:
        seen |= int(r.get("reasons") or 0)
    out["slowdowns"] = [text for bit, text in SLOWDOWN_REASONS.items() if seen & bit]
    return out


def collect(result: dict) -> list[dict]:
    """Every timed figure's device summary in a benchmark result (the ``device`` entry of a
    figure taken with a monitor: :func:`summarize`'s dict)."""
    found: list[dict] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("device"), dict) and "readings" in node["device"]:
                found.append(node["device"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk({k: result.get(k) for k in ("cases", "engine", "big_copy")})
    return found


def run_summary(summaries: list[dict]) -> dict | None:
    """The ranges over every timed row of a run (None when no row has readings)."""
    summaries = [s for s in summaries if s and s.get("readings")]
    if not summaries:
        return None
    out: dict = {"rows": len(summaries)}
    for name in ("sm_mhz", "mem_mhz", "gpu_c", "power_w"):
        spans = [s[name] for s in summaries if name in s]
        if spans:
            out[name] = [min(a for a, _ in spans), max(b for _, b in spans)]
    out["slowdowns"] = sorted({text for s in summaries for text in s.get("slowdowns", [])})
    return out


def describe(summary: dict | None) -> str:
    """One sentence for the benchmark page."""
    if not summary:
        return ""

    def span(name: str, unit: str, fmt: str = "{:.0f}") -> str | None:
        if name not in summary:
            return None
        lo, hi = summary[name]
        return (fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}") + f" {unit}"

    parts = [p for p in (span("sm_mhz", "MHz SM clock"), span("mem_mhz", "MHz memory clock"),
                         span("gpu_c", "°C"), span("power_w", "W")) if p]
    slow = ", ".join(summary.get("slowdowns") or []) or "none"
    return (f"Device state after every timed burst (NVML, {summary['rows']} timed figures): " + ", ".join(parts)
            + f"; clock slowdown reasons seen: {slow}.")
