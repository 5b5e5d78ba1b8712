"""CPU time per process role over a stretch of a benchmark, read from each process's own counters.

Why: a throughput figure alone does not say where a change gained or lost. `CpuByRole` samples the
CPU time (user + system, from /proc via psutil) of every process in the benchmark's tree and of the broker,
and sorts them into roles:

- `broker`: the broker's processes (the embedded broker, or RabbitMQ's beam.smp);
- `source`: the driver's Python process that runs the streaming source (`python_streaming_source_runner`);
- `executors`: the other Python processes Spark starts (pyspark.daemon and its forked workers);
- `jvm`: Spark's JVM;
- `bench`: this process (the pika or client-alone consumer runs here).

A process's time is counted from its value when the stretch began (0 for a process born during it) to its
last sample, so a process that exits between two samples loses at most one interval's time.
"""

from __future__ import annotations

import os

import psutil

from socket_bytes import Sampler

ROLES = ("broker", "source", "executors", "jvm", "bench")
SOURCE_MARKER = "python_streaming_source_runner"


class CpuByRole(Sampler):
    """CPU seconds per role from `with` to its end; `broker` is the broker's root process (or None)."""

    def __init__(self, broker: psutil.Process | None, interval: float = 0.1):
        super().__init__(interval)
        self.broker = broker
        self.me = psutil.Process(os.getpid())
        self.roles: dict[int, str] = {}
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self._baseline = True

    def _processes(self):
        procs = [self.me] + self.me.children(recursive=True)
        if self.broker is not None:
            try:
                procs += [self.broker] + self.broker.children(recursive=True)
            except psutil.Error:
                pass
        return procs

    def _role(self, proc: psutil.Process) -> str:
        if self.broker is not None and (proc.pid == self.broker.pid or proc.pid in self._broker_children):
            return "broker"
        if proc.pid == self.me.pid:
            return "bench"
        cmdline = " ".join(proc.cmdline())
        if SOURCE_MARKER in cmdline:
            return "source"
        if "java" in proc.name() or "java" in cmdline.split(" ", 1)[0]:
            return "jvm"
        return "executors"

    def take(self) -> None:
        try:
            self._broker_children = {p.pid for p in self.broker.children(recursive=True)} if self.broker else set()
        except psutil.Error:
            self._broker_children = set()
        for proc in self._processes():
            try:
                times = proc.cpu_times()
                seconds = times.user + times.system
                if proc.pid not in self.roles:
                    self.roles[proc.pid] = self._role(proc)
                    self.first[proc.pid] = seconds if self._baseline else 0.0
            except psutil.Error:
                continue
            self.last[proc.pid] = seconds
        self._baseline = False

    def seconds(self) -> dict[str, float]:
        """CPU seconds per role over the stretch."""
        out = dict.fromkeys(ROLES, 0.0)
        for pid, role in self.roles.items():
            out[role] += self.last.get(pid, 0.0) - self.first[pid]
        return out

    def per_message(self, messages: int) -> dict[str, float]:
        """Microseconds of CPU per message, per role, and their `total`."""
        out = {role: s * 1e6 / messages for role, s in self.seconds().items()}
        out["total"] = sum(out.values())
        return out


def format_breakdown(us: dict[str, float]) -> str:
    return "  ".join(f"{role} {us[role]:.1f}" for role in (*ROLES, "total") if us.get(role) or role == "total")
