"""Timing one GPU call NVIDIA's way, and the GPU's clocks while it runs (bench/published_cudnn.py):

- `KernelTimer`: the call under torch.profiler (CUPTI) after a 256 MiB L2 flush and an idle gap (10x
  the call's time, at most 1 s, as NVIDIA's published SDPA script slept), its time the sum of the
  device times of the kernels NVIDIA's name filter keeps (`nvidia_keeps`); the wall time without torch.
- `ClockSampler`: nvidia-smi's SM clock, power, temperature and throttle reasons every 100 ms in the
  background, each sample tagged with the phase running then; `smi_clock_power` / `smi_key_lines`:
  `nvidia-smi -q -d CLOCK,POWER` and the lines of it that matter.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time

GAP_FACTOR, GAP_MAX_S = 10.0, 1.0  # their published script slept min(ms / 100, 1) s after each call
L2_FLUSH_BYTES = 256 * 1024 * 1024


def nvidia_keeps(name, backward):
    """Their kernel-name filter: the attention kernels of cuDNN (and the other backends they time);
    XLA's own fusions and torch's copies fall outside it."""
    cudnn = ("cudnn" in name) if backward else name.startswith("cudnn")
    return (cudnn or name.startswith(("kernel_cutlass", "fmha_")) or "flash::" in name
            or "at::native::" in name or "cutlass3x" in name or "(anonymous namespace)::" in name)


# ---------------------------------------------------------------------------------------------- clocks
class ClockSampler:
    """nvidia-smi every 100 ms in the background; each sample is tagged with the phase running then."""

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")

    def __init__(self):
        self.phase, self.samples, self.proc = None, [], None
        fields = list(self.FIELDS)
        for _ in range(2):  # older drivers lack clocks_event_reasons
            try:
                subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                               check=True, capture_output=True, timeout=30)
                break
            except (OSError, subprocess.SubprocessError):
                fields = fields[:3]
        else:
            return
        self.fields = fields
        self.proc = subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={','.join(fields)}",
                                      "--format=csv,noheader,nounits", "-lms", "100"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            values = [v.strip() for v in line.split(",")]
            if self.phase is not None and len(values) == len(self.fields):
                self.samples.append((self.phase, values))

    def summary(self, phase):
        rows = [v for p, v in self.samples if p == phase]
        number = lambda s: float(s) if s.replace(".", "", 1).isdigit() else None  # noqa: E731
        clocks = [c for c in (number(v[0]) for v in rows) if c]
        watts = [w for w in (number(v[1]) for v in rows) if w]
        if not clocks:
            return {}
        out = {"sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks), "power_w_max": max(watts or [0]),
               "samples": len(rows)}
        if len(self.fields) > 3:
            out["event_reasons"] = sorted({v[3] for v in rows})
        return out

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()


def smi_clock_power():
    try:
        return subprocess.run(["nvidia-smi", "-i", "0", "-q", "-d", "CLOCK,POWER"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"nvidia-smi failed: {error}"


def smi_key_lines(text):
    """The lines of `nvidia-smi -q -d CLOCK,POWER` that matter here, in their sections."""
    keep, section, out = ("SM", "Current Power Limit", "Max Power Limit", "Power Draw", "Instantaneous Power Draw",
                          "Average Power Draw"), "", []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and ":" not in stripped:
            section = stripped
        elif stripped.split(":")[0].strip() in keep:
            out.append(f"{section} / {' '.join(stripped.split())}")
    return out


# ------------------------------------------------------------------------------------------ profiling
class KernelTimer:
    """One call under torch.profiler (CUPTI sees every kernel of the process, XLA's included), after
    an L2 flush and an idle gap; returns (ms of the kernels NVIDIA's filter keeps, ms of all kernels,
    kernel names). Without torch (--cpu): the wall time, no names."""

    def __init__(self, use_torch):
        self.torch = None
        if use_torch:
            try:
                import torch
            except ImportError:
                print("no torch: isolated calls are timed by the wall clock", file=sys.stderr)
                return
            self.torch = torch
            self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")

    def kernels(self, prof):
        try:
            events = [(e.name(), e.duration_ns() / 1e6) for e in prof.profiler.kineto_results.events()
                      if "CUDA" in str(e.device_type()) and not e.name().startswith(("Memcpy", "Memset"))]
        except AttributeError:  # another torch: read the trace file instead
            import tempfile
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                prof.export_chrome_trace(f.name)
                trace = json.load(open(f.name))
            events = [(e["name"], e.get("dur", 0) / 1e3) for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
        return events

    def once(self, call, backward):
        if self.torch is None:
            start = time.perf_counter()
            call()
            ms = (time.perf_counter() - start) * 1e3
            return ms, ms, [], "wall"
        from torch.profiler import ProfilerActivity, profile

        self.flush.zero_()
        self.torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            call()
            self.torch.cuda.synchronize()
            wall = (time.perf_counter() - start) * 1e3
        events = self.kernels(prof)
        if not events:  # CUPTI saw nothing (another subscriber?): the call's wall time, flagged
            return wall, wall, [], "wall (the profiler saw no kernels)"
        every = sum(ms for _, ms in events)
        kept = sum(ms for name, ms in events if nvidia_keeps(name, backward))
        if not kept:  # none of the names NVIDIA's filter knows: count them all, and say so
            return every, every, [name for name, _ in events], "cupti, all kernels (none passed NVIDIA's filter)"
        return kept, every, [name for name, _ in events], "cupti"

    def isolated(self, call, backward, iterations, gap=True):
        """Median over `iterations` calls after one warm call, each after an idle gap."""
        samples, total, names, how = [], [], [], None
        for i in range(iterations + 1):
            kept, every, names, how = self.once(call, backward)
            if i and kept:
                samples.append(kept)
                total.append(every)
            if gap and kept:
                time.sleep(min(GAP_FACTOR * kept / 1e3, GAP_MAX_S))
        if not samples:
            return {"error": how}
        return {"ms": statistics.median(samples), "all_kernels_ms": statistics.median(total), "kernels": sorted(set(names)),
                "method": how, "n": len(samples)}
