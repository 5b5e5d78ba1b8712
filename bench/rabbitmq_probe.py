"""Where RabbitMQ's own time goes during a drain, read from the node itself with `rabbitmqctl eval`.

Why: on RabbitMQ the read benchmark's rate is set by the queue's single Erlang process, and its CPU per
message (from the OS, `process_cpu.py`) says how much, not on what. This probe adds two of the node's own
counters, per message drained:

- its schedulers' microstate accounting (OTP's `msacc`): time in Erlang code (`emulator`), in garbage
  collection (`gc`), in socket and port work (`port`), and the rest (`other`: check_io, aux, other);
- the reductions (the VM's unit of work) of the queue's process.

The schedulers' states are counted from `msacc:start/0` to the end, and the accounting is then stopped and
its counters zeroed, so the node is left as it was. `rabbitmqctl` runs outside the CPU sampler's window (each call starts a VM of its
own). Where it cannot run (no rabbitmqctl, no rights to the node's cookie), `QueueProbe` says so once and
reports nothing.
"""

from __future__ import annotations

import re
import subprocess

STATES = ("emulator", "gc", "port", "check_io", "aux", "other")
_warned = False


def _eval(expression: str) -> str:
    return subprocess.run(["rabbitmqctl", "eval", expression], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def _queue_reductions(queue: str) -> int:
    out = _eval(f'{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, <<"{queue}">>)), '
                'element(2, erlang:process_info(amqqueue:get_pid(Q), reductions)).')
    return int(out.strip())


def _microstates() -> dict[str, int]:
    states = ", ".join(STATES)
    out = _eval(f"[{{T, lists:sum([maps:get(T, C, 0) || #{{counters := C}} <- msacc:stats()])}} "
                f"|| T <- [{states}]].")
    return {k: int(v) for k, v in re.findall(r"\{(\w+),(\d+)\}", out)}


class QueueProbe:
    """`with QueueProbe(queue) as probe: drain()`, then `probe.describe(n)`: RabbitMQ's scheduler time by
    state and the queue process's reductions, per message of the `n` drained (the default vhost)."""

    def __init__(self, queue: str):
        self.queue = queue
        self.before: int | None = None
        self.states: dict[str, int] = {}
        self.reductions = 0

    def __enter__(self):
        global _warned
        try:
            self.before = _queue_reductions(self.queue)
            _eval("msacc:start(), msacc:reset(), ok.")
        except (OSError, subprocess.SubprocessError) as exc:
            if not _warned:
                print(f"  (no RabbitMQ microstates: rabbitmqctl eval failed: {exc})")
                _warned = True
            self.before = None
        return self

    def __exit__(self, *exc_info):
        if self.before is None:
            return
        try:
            self.states = _microstates()
            self.reductions = _queue_reductions(self.queue) - self.before
        except (OSError, subprocess.SubprocessError):
            self.states = {}
        finally:
            try:
                _eval("msacc:stop(), msacc:reset(), ok.")
            except (OSError, subprocess.SubprocessError):
                pass

    def describe(self, n: int) -> str | None:
        if not self.states:
            return None
        other = sum(v for k, v in self.states.items() if k not in ("emulator", "gc", "port"))
        return (f"RabbitMQ schedulers us/msg: emulator {self.states.get('emulator', 0) / n:.1f}  "
                f"gc {self.states.get('gc', 0) / n:.1f}  port {self.states.get('port', 0) / n:.1f}  "
                f"other {other / n:.1f}; queue process {self.reductions / n:.0f} reductions/msg")
