"""`amqp-broker` (or `python -m spark_amqp_broker`): run the embedded AMQP 0-9-1 broker in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from spark_amqp import gc_tuning

from . import versions
from .config import BrokerConfig
from .server import Server



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="amqp-broker",
        description="Run the spark-amqp embedded AMQP 0-9-1 broker (speaks RabbitMQ's protocol).")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port to listen on (default 5672; 0 = ephemeral)")
    p.add_argument("--user", action="append", metavar="NAME:PASSWORD",
                   help="a user allowed to connect (repeatable; default guest:guest)")
    p.add_argument("--rabbitmq-version", default=None, metavar="VERSION",
                   help="the RabbitMQ version to behave as where versions differ: "
                        f"{', '.join(sorted(versions.BEHAVIOURS))} (default {versions.DEFAULT_VERSION})")
    p.add_argument("--memory-high-watermark", default=None, metavar="BYTES|FRACTION|off",
                   help="block publishers above this many bytes of queued message data: a byte count "
                        "(1073741824), a fraction of total memory (default 0.4, as RabbitMQ) or off")
    p.add_argument("--consumer-timeout", type=int, default=None, metavar="MS",
                   help="milliseconds a delivery may stay unacked before it times out (default 1800000, "
                        "as RabbitMQ's consumer_timeout)")
    p.add_argument("--channel-tick-interval", type=int, default=None, metavar="MS",
                   help="milliseconds between a channel's ticks, when 3.10 checks the consumer timeout "
                        "(default 60000, as RabbitMQ's channel_tick_interval)")
    tls = p.add_argument_group("TLS (amqps) listener, beside the plain one")
    tls.add_argument("--tls-port", type=int, default=None, metavar="PORT",
                     help="port of the TLS listener (none by default; 5671 is usual; 0 = ephemeral)")
    tls.add_argument("--tls-cert", default=None, metavar="FILE",
                     help="server certificate (chain) PEM file; required with --tls-port")
    tls.add_argument("--tls-key", default=None, metavar="FILE",
                     help="server private key PEM file (unencrypted); required with --tls-port")
    tls.add_argument("--tls-ca", default=None, metavar="FILE",
                     help="CA certificates (PEM) that client certificates are verified against")
    tls.add_argument("--tls-verify-peer", action="store_true", default=None,
                     help="refuse TLS clients without a certificate signed by --tls-ca")
    tls.add_argument("--ssl-cert-login-from", default=None, choices=("distinguished_name", "common_name"),
                     help="the name a verified client certificate logs in as with SASL EXTERNAL "
                          "(default distinguished_name, as RabbitMQ)")
    p.add_argument("--data-dir", default=None,
                   help="directory for durable exchanges, queues, bindings and persistent messages "
                        "(kept across restarts; created if missing)")
    p.add_argument("--definitions", default=None, metavar="FILE",
                   help="RabbitMQ definitions (JSON, as `rabbitmqctl export_definitions` writes) to load: "
                        "users, vhosts, permissions, exchanges, queues, bindings")
    p.add_argument("--config", default=None, help="TOML file with [broker] settings and [users]")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> BrokerConfig:
    users = None
    if args.user:
        users = {}
        for spec in args.user:
            name, sep, password = spec.partition(":")
            # Never echo the value: without a ':' there is no telling where the name ends and the
            # password begins (`bob=secret`), so none of it is shown.
            if not sep:
                raise ValueError("--user expects NAME:PASSWORD; got a value without ':' (not shown)")
            if not name:
                raise ValueError("--user expects NAME:PASSWORD; got an empty NAME (value not shown)")
            users[name] = password
    overrides = {"host": args.host, "port": args.port, "users": users, "data_dir": args.data_dir,
                 "tls_port": args.tls_port, "tls_cert": args.tls_cert, "tls_key": args.tls_key,
                 "tls_ca": args.tls_ca, "tls_verify_peer": args.tls_verify_peer,
                 "definitions": args.definitions, "memory_high_watermark": args.memory_high_watermark,
                 "ssl_cert_login_from": args.ssl_cert_login_from, "rabbitmq_version": args.rabbitmq_version,
                 "consumer_timeout": args.consumer_timeout, "channel_tick_interval": args.channel_tick_interval}
    if args.config:
        return BrokerConfig.from_toml(args.config, **overrides)
    values = {k: v for k, v in overrides.items() if v is not None}
    values.setdefault("port", 5672)
    return BrokerConfig(**values)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = build_config(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        server = Server(config)          # loads the TLS certificate and key, if any
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # This process holds every queued and unacked message, and makes no reference cycles in its steady
    # state: under Python's default thresholds its full collections walked all those messages. Measured
    # draining 1,000,000 x 100 B as the streaming source does (batches acked one batch late, no Spark): 3.8 us
    # of CPU per message with the defaults, 2.8 with gc_tuning's, 2.6-2.7 with collection off. Only this
    # process (the `amqp-broker` command): a broker embedded in someone else's process keeps its thresholds.
    gc_tuning.for_message_holding_process()
    try:
        asyncio.run(_serve(server))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        where = f"{config.host}:{config.port}"
        if config.tls_port is not None:
            where += f" and {config.host}:{config.tls_port} (TLS)"
        print(f"error: cannot listen on {where}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(server: Server) -> None:
    """Serve until SIGTERM or SIGINT, then close every connection with 320 CONNECTION_FORCED (as RabbitMQ
    does on shutdown) and return (exit status 0)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    await stop.wait()
    logging.getLogger("broker.server").info("signal received: shutting down")
    await server.shutdown()


if __name__ == "__main__":
    sys.exit(main())
