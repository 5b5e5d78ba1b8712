"""Where RabbitMQ's own time goes during a drain, read from the node itself with `rabbitmqctl eval`.

Why: on RabbitMQ the read benchmark's rate is set by the queue's single Erlang process, and its CPU per
message (from the OS, `process_cpu.py`) says how much, not on what. This probe adds two of the node's own
counters, per message drained:

- its schedulers' microstate accounting (OTP's `msacc`): time in Erlang code (`emulator`), in garbage
  collection (`gc`), in socket and port work (`port`), and the rest (`other`: check_io, aux, other);
- the reductions (the VM's unit of work) of the queue's process.

The schedulers' states are counted from `msacc:start/0` to the end, and the accounting is then stopped and
its counters zeroed, so the node is left as it was. `rabbitmqctl` runs outside the CPU sampler's window (each call starts a VM of its
own).

Each node is reached by its own rabbitmqctl: `node_ctl(url)` finds, among the host's `rabbitmqctl` (the
RabbitMQ 3.10 node) and `../shared/rabbitmq4/ctl.sh` beside the repository (the RabbitMQ 4.3 node, as
tests/brokers.py finds it), the one whose node listens for AMQP on the URL's port, or says why none does.
Where a probe's calls fail during a run (no rights to the node's cookie, the node gone), `QueueProbe` says so
once per node and reports nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

STATES = ("emulator", "gc", "port", "check_io", "aux", "other")
# The rabbitmqctl commands that may reach a node on this machine: the host's, and the 4.3 reference node's.
CTL_COMMANDS = (("rabbitmqctl",),
                ("bash", str(Path(__file__).resolve().parents[2] / "shared" / "rabbitmq4" / "ctl.sh")))
_warned: set[tuple[str, ...]] = set()


def _eval(ctl, expression: str) -> str:
    return subprocess.run([*ctl, "eval", expression], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def _failure(exc: Exception) -> str:
    """What a failed rabbitmqctl call says: its last line on stderr if it wrote one."""
    stderr = (getattr(exc, "stderr", None) or "").strip()
    return stderr.splitlines()[-1] if stderr else str(exc)


def node_ctl(url: str) -> tuple[tuple[str, ...] | None, str]:
    """(the rabbitmqctl command whose node listens for AMQP on `url`'s port, "") or (None, why none)."""
    port = urlparse(url).port or 5672
    tried = []
    for ctl in CTL_COMMANDS:
        name = ctl[-1]
        if shutil.which(ctl[0]) is None or (len(ctl) > 1 and not Path(name).exists()):
            tried.append(f"{name}: not found")
            continue
        try:
            out = _eval(ctl, "[element(6, L) || L <- rabbit_networking:node_listeners(node()), "
                             "element(3, L) =:= amqp].")
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{name}: {_failure(exc)}")
            continue
        ports = [int(p) for p in re.findall(r"\d+", out)]
        if port in ports:
            return ctl, ""
        tried.append(f"{name}: its node listens on {', '.join(map(str, ports)) or 'no AMQP port'}")
    return None, f"no rabbitmqctl reaches the node on port {port} ({'; '.join(tried)})"


def _queue_reductions(ctl, queue: str) -> int:
    out = _eval(ctl, f'{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, <<"{queue}">>)), '
                     'element(2, erlang:process_info(amqqueue:get_pid(Q), reductions)).')
    return int(out.strip())


def _microstates(ctl) -> dict[str, int]:
    states = ", ".join(STATES)
    out = _eval(ctl, f"[{{T, lists:sum([maps:get(T, C, 0) || #{{counters := C}} <- msacc:stats()])}} "
                     f"|| T <- [{states}]].")
    return {k: int(v) for k, v in re.findall(r"\{(\w+),(\d+)\}", out)}


class QueueProbe:
    """`with QueueProbe(queue, ctl) as probe: drain()`, then `probe.describe(n)`: RabbitMQ's scheduler time
    by state and the queue process's reductions, per message of the `n` drained (the default vhost), on the
    node `ctl` reaches (`node_ctl`; default: the host's rabbitmqctl)."""

    def __init__(self, queue: str, ctl=("rabbitmqctl",)):
        self.queue = queue
        self.ctl = tuple(ctl)
        self.before: int | None = None
        self.states: dict[str, int] = {}
        self.reductions = 0

    def __enter__(self):
        try:
            self.before = _queue_reductions(self.ctl, self.queue)
            _eval(self.ctl, "msacc:start(), msacc:reset(), ok.")
        except (OSError, subprocess.SubprocessError) as exc:
            if self.ctl not in _warned:
                print(f"  (no RabbitMQ microstates: {' '.join(self.ctl)} eval failed: {_failure(exc)})")
                _warned.add(self.ctl)
            self.before = None
        return self

    def __exit__(self, *exc_info):
        if self.before is None:
            return
        try:
            self.states = _microstates(self.ctl)
            self.reductions = _queue_reductions(self.ctl, self.queue) - self.before
        except (OSError, subprocess.SubprocessError):
            self.states = {}
        finally:
            try:
                _eval(self.ctl, "msacc:stop(), msacc:reset(), ok.")
            except (OSError, subprocess.SubprocessError):
                pass

    def describe(self, n: int) -> str | None:
        if not self.states:
            return None
        other = sum(v for k, v in self.states.items() if k not in ("emulator", "gc", "port"))
        return (f"RabbitMQ schedulers us/msg: emulator {self.states.get('emulator', 0) / n:.1f}  "
                f"gc {self.states.get('gc', 0) / n:.1f}  port {self.states.get('port', 0) / n:.1f}  "
                f"other {other / n:.1f}; queue process {self.reductions / n:.0f} reductions/msg")
