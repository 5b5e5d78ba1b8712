"""`Broker`: the embedded broker in a background thread, for tests, notebooks and the main job."""

from __future__ import annotations

import asyncio
import logging
import threading

from . import limits, policies, super_streams
from .config import BrokerConfig
from .server import Server

log = logging.getLogger("broker.embedded")


class Broker:
    """A running AMQP 0-9-1 broker on 127.0.0.1 (by default on an ephemeral port).

        with Broker(port=0) as b:
            b.url   # amqp://guest:guest@127.0.0.1:<port>/%2F

    Keyword arguments are those of `BrokerConfig` (rabbitmq_version: "4.3", the default, or "3.10";
    users, vhosts, permissions, topic_permissions, loopback_users, definitions, heartbeat, frame_max,
    channel_max, max_message_size, max_connections, memory_high_watermark, ...), and for a TLS listener beside the
    plain one: tls_port (0 = ephemeral), tls_cert, tls_key (PEM paths), tls_ca and tls_verify_peer:

        with Broker(port=0, tls_port=0, tls_cert="server.pem", tls_key="server.key") as b:
            b.tls_url   # amqps://guest:guest@localhost:<tls_port>/%2F

    Both listeners share one broker (the same queues, users and connection limit); `stop()` closes both,
    after sending every open connection connection.close 320 CONNECTION_FORCED (see `stop`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options):
        self.config = options.pop("config", None) or BrokerConfig(host=host, port=port, **options)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Server | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def host(self) -> str:
        return self.config.host

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the broker is not started")
        return self._server.port

    @property
    def url(self) -> str:
        user, password = self.config.plain_credentials()
        return f"amqp://{user}:{password}@{self.host}:{self.port}/%2F"

    @property
    def tls_port(self) -> int | None:
        """The TLS listener's port (the actual one when tls_port=0 was asked for); None without TLS."""
        if self._server is None:
            raise RuntimeError("the broker is not started")
        return self._server.tls_port

    @property
    def tls_url(self) -> str:
        """amqps://guest:guest@localhost:<tls_port>/%2F (the first configured user).

        The host is the name `localhost`, not 127.0.0.1, when the broker listens on a loopback or wildcard
        address: clients check the server certificate against the host name in the URL, and a certificate
        for "localhost" (the usual test certificate, e.g. trustme's `issue_cert("localhost", ...)`) then
        matches. Listening on another address, the URL carries that address. Raises RuntimeError when the
        broker has no TLS listener."""
        port = self.tls_port
        if port is None:
            raise RuntimeError("the broker has no TLS listener: start it with tls_port (and tls_cert, tls_key)")
        user, password = self.config.plain_credentials()
        host = "localhost" if self.host in _LOCAL_HOSTS else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"amqps://{user}:{password}@{host}:{port}/%2F"

    @property
    def core(self):
        """The broker's state, for inspection in tests (read it from the broker's thread only via call())."""
        return self._server.core

    def call(self, fn, *args):
        """Run fn(*args) on the broker's event loop thread and return its result."""
        future = asyncio.run_coroutine_threadsafe(_call(fn, *args), self._loop)
        return future.result(timeout=10)

    # --- policies (rabbitmqctl set_policy / clear_policy / set_operator_policy / clear_operator_policy) ----

    def set_policy(self, name: str, pattern: str, definition: dict, *, vhost: str = "/", apply_to: str = "all",
                   priority: int = 0) -> None:
        """Set (or replace) a policy, as `rabbitmqctl set_policy` does: the vhost's matching queues and
        exchanges act on it at once. ValueError with RabbitMQ's text when RabbitMQ would refuse it (an unknown
        apply-to or key, a bad regular expression, a value of the wrong type). Kept across restarts with
        data_dir. Before start() it is added to the configuration."""
        self._set(policies.POLICY, name, pattern, definition, vhost, apply_to, priority)

    def clear_policy(self, name: str, vhost: str = "/") -> None:
        """Remove a policy (`rabbitmqctl clear_policy`); ValueError when there is none of that name."""
        self._clear(policies.POLICY, name, vhost)

    def set_operator_policy(self, name: str, pattern: str, definition: dict, *, vhost: str = "/",
                            apply_to: str = "all", priority: int = 0) -> None:
        """Set an operator policy (`rabbitmqctl set_operator_policy`): merged with the policy a queue has."""
        self._set(policies.OPERATOR_POLICY, name, pattern, definition, vhost, apply_to, priority)

    def clear_operator_policy(self, name: str, vhost: str = "/") -> None:
        self._clear(policies.OPERATOR_POLICY, name, vhost)

    def _set(self, kind, name, pattern, definition, vhost, apply_to, priority) -> None:
        policy = policies.validate(kind, vhost, name, pattern, definition, priority, apply_to,
                                   behaviour=self.config.behaviour)
        if vhost not in self.config.all_vhosts:
            raise ValueError(f"no such vhost '{vhost}' (vhosts: {list(self.config.all_vhosts)})")
        if self._server is None:
            self.config.policy_list = [p for p in self.config.policy_list
                                       if (p.kind, p.vhost, p.name) != (kind, vhost, name)] + [policy]
            return
        self.call(self.core.set_policy, policy)

    def _clear(self, kind, name, vhost) -> None:
        if self._server is None:
            before = len(self.config.policy_list)
            self.config.policy_list = [p for p in self.config.policy_list
                                       if (p.kind, p.vhost, p.name) != (kind, vhost, name)]
            found = len(self.config.policy_list) != before
        else:
            found = self.call(self.core.clear_policy, kind, vhost, name)
        if not found:
            what = "operator policy" if kind == policies.OPERATOR_POLICY else "policy"
            raise ValueError(f"{what} '{name}' in vhost '{vhost}' not found")

    # --- super streams (rabbitmq-streams add_super_stream / delete_super_stream) -----------------------------

    def add_super_stream(self, name: str, partitions: int | None = None, binding_keys=None, *, vhost: str = "/",
                         arguments: dict | None = None) -> list[str]:
        """Create super stream `name` as `rabbitmq-streams add_super_stream` does on RabbitMQ 4.3: a durable
        direct exchange (`x-super-stream: true`), `partitions` streams NAME-0.. (3 by default) or one
        stream NAME-key per binding key (a list or "eu,us,ap"), each bound with its key and
        `x-stream-partition-order`. `arguments` are extra x- arguments of the streams. Returns the
        streams' names; ValueError with RabbitMQ's text when it would refuse (super_streams.py). Kept
        across restarts with data_dir, as any durable declaration."""
        ss = super_streams.plan(name, partitions, binding_keys, arguments)
        self.call(super_streams.apply, self._vhost(vhost), ss)
        return list(ss.partitions)

    def delete_super_stream(self, name: str, *, vhost: str = "/") -> None:
        """Delete super stream `name`: its exchange and the streams bound to it (their consumers get
        basic.cancel). ValueError("stream_not_found") when there is no such exchange, as RabbitMQ's CLI."""
        self.call(super_streams.delete, self._vhost(vhost), name)

    def _vhost(self, name: str):
        if self._server is None:
            raise RuntimeError("the broker is not started")
        vhost = self.core.vhosts.get(name)
        if vhost is None:
            raise ValueError(f"no such vhost '{name}' (vhosts: {list(self.core.vhosts)})")
        return vhost

    def start(self) -> "Broker":
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="amqp-broker", daemon=True)
        self._thread.start()
        self._started.wait(timeout=10)
        if self._error is not None:
            raise self._error
        if not self._started.is_set():
            raise RuntimeError("the embedded broker did not start within 10 s")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self._server = Server(self.config)   # builds the TLS context: a bad certificate fails here
            loop.run_until_complete(self._server.start())
        except BaseException as exc:  # e.g. the port is taken
            self._error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._server.stop())
            loop.close()

    def stop(self, grace: float = limits.STOP_GRACE) -> None:
        """Close every open connection with connection.close 320 CONNECTION_FORCED "broker forced
        connection closure with reason 'shutdown'" (as RabbitMQ on shutdown, and as this broker on SIGTERM),
        wait up to `grace` seconds for the clients' close-ok, then drop what is left and stop the thread.
        Clients thus learn why their connection ended instead of seeing a reset socket."""
        if self._thread is None:
            return
        if self._loop is not None and self._loop.is_running():
            future = asyncio.run_coroutine_threadsafe(self._server.shutdown(grace), self._loop)
            try:
                future.result(timeout=grace + 10)
            except Exception:   # the loop is stopped below whatever happened; the sockets are aborted
                log.exception("embedded broker: shutdown failed")
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._thread = None

    def __enter__(self) -> "Broker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""}


async def _call(fn, *args):
    return fn(*args)
