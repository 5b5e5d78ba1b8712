"""Every option of the `amqp` source and sink: name, default, check, and what it means.

Options are camelCase like Spark's Kafka source and case-insensitive. `parse(options, role)` validates all
of them when a query starts and raises `OptionError` naming the option, the value and what is allowed.
Credentials never appear in errors: a bad `uri` is reported with its password replaced by `***`.
docs/options.md is this module's table (`markdown_table()`).
"""

from __future__ import annotations

import difflib
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable

from .client.channel import DEFAULT_WINDOW
from .client.connection import DEFAULT_CONNECT_TIMEOUT, DEFAULT_HEARTBEAT
from .client.tls import TLSOptions
from .client.uri import parse_uri, redact


class OptionError(ValueError):
    """A bad option value: says which option, the value given, and what is allowed."""

    def __init__(self, name: str, value: Any, allowed: str):
        shown = redact(value) if name == "uri" and isinstance(value, str) else value
        super().__init__(f"option '{name}': got {shown!r}; {allowed}")
        self.option = name


def _positive_int(name, value):
    try:
        n = int(str(value).strip())
    except ValueError:
        raise OptionError(name, value, "expected a positive integer") from None
    if n <= 0:
        raise OptionError(name, value, "expected a positive integer")
    return n


def _bool(name, value):
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    raise OptionError(name, value, "expected true or false")


def _choice(*allowed):
    def check(name, value):
        text = str(value).strip().lower()
        if text not in allowed:
            raise OptionError(name, value, "allowed: " + ", ".join(allowed))
        return text
    return check


def _json_object(name, value):
    try:
        doc = json.loads(value)
    except ValueError as exc:
        raise OptionError(name, value, f"expected a JSON object ({exc})") from None
    if not isinstance(doc, dict):
        raise OptionError(name, value, "expected a JSON object, e.g. {\"x-max-length\": 1000}")
    return doc


def _names(name, value):
    names = [n.strip() for n in str(value).split(",")]
    if not all(names):
        raise OptionError(name, value, "expected a comma-separated list of non-empty names")
    if len(set(names)) != len(names):
        raise OptionError(name, value, "a name is listed twice")
    for n in names:
        if len(n.encode()) > 255:
            raise OptionError(name, value, "names are at most 255 bytes")
    return names


def _stream_offsets(name, value):
    """`earliest`, `latest`, or a JSON object of stream name -> offset (Kafka's -2 = earliest, -1 = latest)."""
    text = str(value).strip()
    if text.lower() in ("earliest", "latest"):
        return text.lower()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not doc or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= -2 for v in doc.values()):
        raise OptionError(name, value, 'expected earliest, latest, or a JSON object of stream -> offset, '
                                       'e.g. {"events": 1200} (-2: earliest, -1: latest)')
    return doc


def _timestamp_ms(name, value):
    try:
        n = int(str(value).strip())
    except ValueError:
        raise OptionError(name, value, "expected milliseconds since the epoch (UTC)") from None
    if n < 0:
        raise OptionError(name, value, "expected milliseconds since the epoch (UTC)")
    return n


def _keys(name, value):
    return [k.strip() for k in str(value).split(",")]


def _uri(name, value):
    try:
        parse_uri(str(value))
    except Exception as exc:  # the parser's message never includes the password
        raise OptionError(name, value, f"expected amqp://user:password@host:port/vhost ({exc})") from None
    return str(value)


def _shortstr(name, value):
    if len(str(value).encode()) > 255:
        raise OptionError(name, value, "at most 255 bytes")
    return str(value)


def _seconds(name, value):
    try:
        n = float(str(value).strip())
    except ValueError:
        raise OptionError(name, value, "expected a number of seconds > 0") from None
    if n <= 0:
        raise OptionError(name, value, "expected a number of seconds > 0")
    return n


def _text(name, value):
    return str(value)


def _pem_file(name, value):
    """A PEM file, read now on the driver: its contents travel with the query, so executors need no copy."""
    path = str(value).strip()
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionError(name, path, f"expected a readable PEM file ({getattr(exc, 'strerror', None) or exc})") \
            from None
    if "-----BEGIN" not in text:
        raise OptionError(name, path, "expected a PEM file (-----BEGIN ...)")
    return text


@dataclass(frozen=True)
class Option:
    name: str
    roles: str             # "source", "sink" or "both"
    default: Any
    check: Callable
    doc: str
    pyspark: str = "4.0"   # the oldest PySpark the option works on (docs/source.md, "PySpark versions")


OPTIONS = (
    Option("uri", "both", None, _uri,
           "Broker URI `amqp://user:password@host:port/vhost` (vhost percent-encoded: `/%2F` is `/`). Required."),
    Option("username", "both", None, _text,
           "User name; overrides the one in `uri`."),
    Option("password", "both", None, _text,
           "Password; overrides the one in `uri`. Spark redacts an option named `password` in query plans "
           "(it redacts `uri` only with `spark_amqp.register(spark)` or "
           "`spark.sql.redaction.options.regex=(?i)url|uri`), so prefer this to a password inside `uri`."),
    Option("queue", "source", None, _names,
           "Queue(s) to consume, comma-separated. Required for the source."),
    Option("exchange", "both", None, _shortstr,
           "Source: exchange to bind the queue(s) to (with `declare=declare`). Sink: the exchange of every "
           "row; given, it overrides an `exchange` column (without either: the default exchange `\"\"`)."),
    Option("routingKey", "sink", None, _shortstr,
           "Sink: the routing key of every row; given, it overrides a `routing_key` column (a row read from "
           "queue `q` carries `q` there)."),
    Option("bindingKeys", "source", None, _keys,
           "Source: binding keys for the queue-to-exchange bindings, comma-separated (default: the queue name)."),
    Option("declare", "source", "passive", _choice("none", "passive", "declare"),
           "Source: `passive` checks the queue exists (a clear error if not); `declare` declares it (and "
           "binds it to `exchange`); `none` does neither."),
    Option("queueArguments", "source", None, _json_object,
           "Source: JSON object of queue arguments used with `declare=declare`, e.g. `{\"x-max-length\": 1000}`."),
    Option("durable", "source", True, _bool, "Source: declare the queue durable (with `declare=declare`)."),
    Option("prefetch", "source", None, _positive_int,
           "Source: deliveries the broker may push ahead per queue (default: 2 x maxMessagesPerTrigger, "
           "at least 1000; without maxMessagesPerTrigger 200000, or 40000 on RabbitMQ, whose queue process "
           "does more work for every delivery held unacked until its batch commits). A micro-batch takes "
           "at most half, so two batches in flight never stall the stream. Above 65535 (basic.qos's "
           "limit) it is spread over several consuming channels on the queue."),
    Option("maxMessagesPerTrigger", "source", None, _positive_int,
           "Source: most messages in one micro-batch (default: no limit beyond prefetch). PySpark 4.2+ "
           "applies it as a read limit; on 4.0 and 4.1 the source applies it itself."),
    Option("maxBytesPerTrigger", "source", 64 * 2**20, _positive_int,
           "Queue mode: message bodies in one micro-batch, at most about this many bytes (default 67108864, "
           "64 MiB; the message that reaches it is the batch's last). It keeps a batch within what the "
           "driver's JVM holds comfortably (4 KB messages in batches of 100,000 ran its default 1 GB heap "
           "out of memory). Without `prefetch`, the prefetch is lowered, once message sizes are known, to "
           "what two batches of this size take."),
    Option("queueType", "source", "classic", _choice("classic", "quorum", "stream"),
           "Source: `classic` and `quorum` consume with acks (queue mode; with `declare=declare`, `quorum` "
           "declares a quorum queue); `stream` reads stream queues by offset ranges on executors (stream "
           "mode: nothing is acked or removed)."),
    Option("startingOffsets", "source", None, _stream_offsets,
           "Stream mode: where a new query (or a batch read) starts: `earliest`, `latest`, or JSON per stream "
           "`{\"events\": 1200}` (-2 earliest, -1 latest). Default: `latest` for a stream query, `earliest` "
           "for a batch read. A query restarted from its checkpoint continues from there."),
    Option("startingTimestamp", "source", None, _timestamp_ms,
           "Stream mode: start every stream at its first message stored at or after this time (ms since the "
           "epoch; the broker resolves it in whole seconds). Takes precedence over startingOffsets."),
    Option("endingOffsets", "source", None, _stream_offsets,
           "Stream mode, batch read: where to stop (exclusive): `latest` (default) or JSON per stream."),
    Option("failOnDataLoss", "source", True, _bool,
           "Stream mode: fail when retention removed offsets the query still had to read (default); "
           "`false`: log what was skipped and continue from the first offset still there."),
    Option("minPartitions", "source", None, _positive_int,
           "Stream mode: split the offset ranges of a batch into at least this many partitions "
           "(default: one per stream with new messages, and one per 100,000 offsets of a longer range)."),
    Option("superStream", "both", None, _shortstr,
           "A super stream (RabbitMQ 3.11+: a partitioned stream, `rabbitmq-streams add_super_stream`). "
           "Source: read every partition as one query (stream mode, offsets per partition; a partition "
           "added later is read from its first offset). Sink: publish each row to the partition its "
           "`routing_key` hashes to, as RabbitMQ's stream clients choose it. Partitions are the streams "
           "`NAME-0`, `NAME-1`, ... unless `superStreamPartitions` lists them."),
    Option("superStreamPartitions", "both", None, _names,
           "The partition streams of `superStream`, comma-separated in partition order "
           "(`x-stream-partition-order`), for a super stream whose partitions are not `NAME-0`, `NAME-1`, "
           "... (made with `--binding-keys eu,us`: `NAME-eu,NAME-us`)."),
    Option("streamFilter", "source", None, _names,
           "Stream mode: read only messages whose filter value (header `x-stream-filter-value`, RabbitMQ "
           "3.13+) is one of these, comma-separated. The broker skips chunks without them (`x-stream-filter`); "
           "the source drops the rest of the chunks it sends."),
    Option("streamMatchUnfiltered", "source", False, _bool,
           "Stream mode, with `streamFilter`: also read messages without a filter value "
           "(`x-stream-match-unfiltered`)."),
    Option("journalPath", "source", None, _text,
           "Queue mode: directory (local, or any URI pyarrow reaches: `file://`, `s3://`, `hdfs://`) where "
           "each micro-batch's rows are written before Spark records its offset. A batch re-run after a "
           "restart is then served from there, row for row the same, and the broker's redelivered copies "
           "of its messages are acked and dropped: exactly-once with an idempotent sink. One per query."),
    Option("ackAt", "source", None, _choice("journal", "commit"),
           "Queue mode: when a batch's deliveries are acked. `journal` (the default with `journalPath` on "
           "PySpark 4.2+; on 4.0 and 4.1 `commit` is): as "
           "soon as the batch's journal file is durable, before Spark runs it, so however long a batch "
           "runs it does not meet RabbitMQ's consumer timeout, and a restart replays the batch from the "
           "journal. `commit` (the default, and the only choice, without `journalPath`): once Spark has "
           "committed the batch."),
    Option("onConsumerTimeout", "source", "fail", _choice("fail", "continue"),
           "Queue mode, without `journalPath`: what the query does when the broker times out its consumer "
           "(RabbitMQ's consumer timeout: a delivery held unacked longer than it allows, as when a trigger "
           "interval plus a batch's run time exceeds it). `fail` (default) stops the query with the cause "
           "and the fixes: the messages the broker takes back were already read, and going on would read "
           "them again. `continue` logs the same once and reads them again. With `journalPath` the query "
           "always goes on: the copies are dropped."),
    Option("consumerTimeout", "source", None, _positive_int,
           "Queue mode: milliseconds RabbitMQ 4.x lets this query's consumers hold a delivery of a quorum "
           "queue unacked (consumer argument `x-consumer-timeout`, which takes precedence over the queue's "
           "argument, its policy and the broker's `consumer_timeout`). Set it above the trigger interval "
           "plus the longest batch's run time when the broker's timeout is shorter. RabbitMQ 3.x ignores "
           "it; RabbitMQ 4.x refuses it on a classic queue (whose consumers it never times out)."),
    Option("handoffPath", "source", None, _text,
           "Queue mode: directory every executor can read (any local path in local mode, else a shared "
           "filesystem URI such as `hdfs://` or `s3://`) where the driver writes each micro-batch's "
           "partitions as Arrow files for the executors to read, instead of sending the rows inside "
           "Spark's tasks through the driver's JVM (without it, see `handoff`). Files are removed when their batch "
           "commits. One per query."),
    Option("handoff", "source", "auto", _choice("auto", "inline"),
           "Queue mode, without `handoffPath`: `auto` (default) hands batches to the executors as files in "
           "a directory of its own under Spark's local directory once the first batch shows that they run "
           "inside the driver's JVM (local mode), else inside Spark's tasks; `inline` always inside the tasks."),
    Option("ack", "source", False, _bool,
           "Batch read (`spark.read`): ack what was read once the read completes (default: return it to the queue)."),
    Option("maxMessages", "source", None, _positive_int,
           "Batch read: read at most this many messages (default: what the queue holds now)."),
    Option("mandatory", "sink", False, _bool,
           "Sink: publish with mandatory=true; an unroutable row fails the task naming exchange and key."),
    Option("confirmTimeout", "sink", 60.0, _seconds,
           "Sink: seconds a task waits for outstanding publisher confirms before it fails."),
    Option("publishWindow", "sink", DEFAULT_WINDOW, _positive_int,
           "Sink: most unconfirmed publishes in flight per task."),
    Option("filterValue", "sink", None, _shortstr,
           "Sink: the stream filter value (header `x-stream-filter-value`) of every row; given, it overrides "
           "a `filter_value` column. Consumers with `streamFilter` read by it."),
    Option("messageId", "sink", "none", _choice("none", "deterministic"),
           "Sink: `deterministic` gives rows without a message_id one derived from (query id, batch, "
           "partition, row), so consumers can drop duplicates after a retried task."),
    Option("ignoreUnknownColumns", "sink", False, _bool,
           "Sink: ignore columns that are not part of the row schema (default: they are an error)."),
    Option("tls.caFile", "both", None, _pem_file,
           "TLS (`amqps://`): PEM file of the CA(s) that signed the broker's certificate (default: the "
           "system's CAs). Read on the driver; executors get its contents."),
    Option("tls.certFile", "both", None, _pem_file,
           "TLS: PEM file of the client certificate, for brokers that verify clients (and for EXTERNAL). "
           "Read on the driver; executors get its contents."),
    Option("tls.keyFile", "both", None, _pem_file,
           "TLS: PEM file of the client certificate's private key (default: in tls.certFile). Read on the "
           "driver; executors get its contents (never shown in plans or errors)."),
    Option("tls.verify", "both", True, _bool,
           "TLS: check the broker's certificate chain and host name (`false` only for tests)."),
    Option("tls.serverName", "both", None, _shortstr,
           "TLS: the host name to send (SNI) and to check the certificate against, when the URI's host "
           "differs from the name in the broker's certificate."),
    Option("authMechanism", "both", "PLAIN", _choice("plain", "amqplain", "external"),
           "SASL mechanism: `PLAIN` (default), `AMQPLAIN`, or `EXTERNAL` (the broker takes the user from "
           "the TLS client certificate)."),
    Option("heartbeat", "both", DEFAULT_HEARTBEAT, _positive_int, "Heartbeat interval (seconds) asked of the broker."),
    Option("connectTimeout", "both", DEFAULT_CONNECT_TIMEOUT, _seconds, "Seconds to wait for a TCP connection and handshake."),
)
BY_KEY = {o.name.lower(): o for o in OPTIONS}


def markdown_table() -> str:
    """The README's options table, made from OPTIONS (tests/test_readme.py keeps the README in step)."""
    def shown(default):
        if default is None:
            return "—"
        return f"`{str(default).lower() if isinstance(default, bool) else default}`"
    lines = ["| option | applies to | default | PySpark | meaning |", "|---|---|---|---|---|"]
    # A `|` splits a table cell even inside backticks: escaped.
    lines += [f"| `{o.name}` | {o.roles} | {shown(o.default)} | {o.pyspark}+ | {o.doc.replace('|', chr(92) + '|')} |"
              for o in OPTIONS]
    return "\n".join(lines)
BY_KEY["url"] = BY_KEY["uri"]     # an alias that Spark's default redaction (`(?i)url`) hides in plans


# What users of Spark's Kafka source (and of other AMQP tools) reach for, and this connector's name for it.
NAMES_ELSEWHERE = {
    "maxoffsetspertrigger": "maxMessagesPerTrigger", "maxrecordspertrigger": "maxMessagesPerTrigger",
    "subscribe": "queue", "queues": "queue", "kafka.bootstrap.servers": "uri", "host": "uri",
    "topic": "routingKey", "routing_key": "routingKey", "prefetchcount": "prefetch", "qos": "prefetch",
}


def suggestion(key: str, role: str) -> str:
    """' Did you mean ...?' for an unknown option key, or ''."""
    names = {o.name.lower(): o.name for o in OPTIONS if o.roles in (role, "both")}
    known = NAMES_ELSEWHERE.get(key.lower())
    if known is None or known.lower() not in names:
        close = difflib.get_close_matches(key.lower(), list(names), n=1, cutoff=0.75)
        known = names[close[0]] if close else None
    return f" Did you mean '{known}'?" if known else ""


def with_credentials(uri: str, username: str | None, password: str | None) -> str:
    """The URI with its user and/or password replaced (percent-encoded)."""
    scheme, _, rest = uri.partition("://")
    authority, slash, tail = rest.partition("/")
    userinfo, at, hostport = authority.rpartition("@")
    user_raw, colon, pass_raw = userinfo.partition(":") if at else ("guest", ":", "guest")
    user = urllib.parse.quote(username, safe="") if username is not None else user_raw
    secret = urllib.parse.quote(password, safe="") if password is not None else pass_raw
    return f"{scheme}://{user}:{secret}@{hostport}{slash}{tail}"


class Options(dict):
    """Validated options by their canonical camelCase name (a plain dict, so it pickles)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:  # never show the password or key material (plans, logs, tracebacks)
        return repr({k: redact(v) if k == "uri" and v else "***" if k in SECRET_KEYS and v else
                     "<PEM>" if k.startswith("tls.") and k.endswith("File") and v else v
                     for k, v in self.items()})

    __str__ = __repr__


SECRET_KEYS = ("password", "tls.keyFile")


def connect_kwargs(options) -> dict:
    """The keyword arguments of `Connection.open` that validated options give (driver and executors)."""
    tls = None
    if parse_uri(options["uri"]).tls:
        tls = TLSOptions(ca=options.get("tls.caFile"), cert=options.get("tls.certFile"),
                         key=options.get("tls.keyFile"), verify=options.get("tls.verify", True),
                         server_name=options.get("tls.serverName"))
    return {"heartbeat": int(options.get("heartbeat") or DEFAULT_HEARTBEAT),
            "connect_timeout": float(options.get("connectTimeout") or DEFAULT_CONNECT_TIMEOUT),
            "tls": tls, "auth_mechanism": str(options.get("authMechanism") or "plain").upper()}


def parse(options, role: str) -> Options:
    """Validate `options` (a mapping, keys in any case) for `role` = "source" or "sink"."""
    out = Options({o.name: o.default for o in OPTIONS if o.roles in (role, "both")})
    for key, value in dict(options).items():
        opt = BY_KEY.get(str(key).lower())
        if key.lower() in ("path", "checkpointlocation") or opt is None and key.lower().startswith("spark."):
            continue
        if opt is None:
            allowed = ", ".join(o.name for o in OPTIONS if o.roles in (role, "both"))
            raise OptionError(key, "…" if "uri" in key.lower() else value,
                              f"unknown option for the amqp {role}.{suggestion(key, role)} "
                              f"Known options: {allowed}")
        if opt.roles not in (role, "both"):
            raise OptionError(opt.name, value, f"this option applies to the {opt.roles} only")
        out[opt.name] = opt.check(opt.name, value)
    if out.get("uri") is None:
        raise OptionError("uri", None, "required: the broker URI amqp://user:password@host:port/vhost")
    if out.get("username") is not None or out.get("password") is not None:
        out["uri"] = with_credentials(out["uri"], out.get("username"), out.get("password"))
    given_tls = [o.name for o in OPTIONS if o.name.startswith("tls.") and out.get(o.name) is not None
                 and o.name != "tls.verify"] + (["tls.verify"] if out.get("tls.verify") is False else [])
    if given_tls and not parse_uri(out["uri"]).tls:
        raise OptionError(given_tls[0], "…", "TLS options need an amqps:// uri (the broker's TLS port, "
                          "usually 5671)")
    if out.get("authMechanism") == "external" and not out.get("tls.certFile"):
        raise OptionError("authMechanism", "EXTERNAL", "EXTERNAL authenticates with the TLS client "
                          "certificate: set tls.certFile (and tls.keyFile) with an amqps:// uri")
    if out.get("superStreamPartitions") and not out.get("superStream"):
        raise OptionError("superStreamPartitions", ",".join(out["superStreamPartitions"]),
                          "needs the option 'superStream'")
    if role == "sink" and out.get("superStream") and out.get("exchange") is not None:
        raise OptionError("exchange", out["exchange"], f"contradicts superStream={out['superStream']!r} (rows "
                          "go to its partitions): set one of the two")
    if role == "source":
        if out.get("superStream"):
            if out.get("queue"):
                raise OptionError("queue", ",".join(out["queue"]), f"contradicts superStream="
                                  f"{out['superStream']!r} (its partitions are the streams read): set one")
            if "queuetype" in {str(k).lower() for k in dict(options)} and out["queueType"] != "stream":
                raise OptionError("queueType", out["queueType"], "a super stream is read in stream mode: "
                                  "leave queueType unset or set it to stream")
            out["queueType"] = "stream"
        elif not out.get("queue"):
            raise OptionError("queue", None, "required: the queue(s) to consume (or superStream)")
        if out["queueType"] != "stream" and (out.get("streamFilter") or out.get("streamMatchUnfiltered")):
            name = "streamFilter" if out.get("streamFilter") else "streamMatchUnfiltered"
            raise OptionError(name, "…", "applies to stream queues only: set queueType=stream")
        if out.get("streamMatchUnfiltered") and not out.get("streamFilter"):
            raise OptionError("streamMatchUnfiltered", True, "needs the option 'streamFilter'")
        stream_only = ("startingOffsets", "startingTimestamp", "endingOffsets", "minPartitions")
        given = [n for n in stream_only if out.get(n) is not None] + \
            (["failOnDataLoss"] if out.get("failOnDataLoss") is False else [])
        if out["queueType"] != "stream" and given:
            raise OptionError(given[0], "…", "applies to stream queues only: set queueType=stream")
        if out["queueType"] == "stream" and out.get("journalPath"):
            raise OptionError("journalPath", out["journalPath"], "applies to queue mode only: stream mode "
                              "re-reads a batch's offset range exactly without a journal")
        if out.get("ackAt") == "journal" and not out.get("journalPath"):
            raise OptionError("ackAt", "journal", "acks at the journal write need journalPath (a batch acked "
                              "before its commit is replayed from the journal)")
        for name in ("ackAt", "consumerTimeout"):
            if out["queueType"] == "stream" and out.get(name):
                raise OptionError(name, out[name], "applies to queue mode only: stream mode acks nothing")
        if out["queueType"] == "stream" and out.get("handoffPath"):
            raise OptionError("handoffPath", out["handoffPath"], "applies to queue mode only: in stream mode "
                              "the executors read the streams themselves")
        ending = out.get("endingOffsets")
        if ending == "earliest" or (isinstance(ending, dict) and -2 in ending.values()):
            # As Spark's Kafka source: a read that ends where the stream begins reads nothing.
            raise OptionError("endingOffsets", ending if isinstance(ending, str) else json.dumps(ending),
                              "an end cannot be earliest (-2): expected latest, or a JSON object of stream "
                              "-> offset (-1: latest)")
        if out["queueType"] == "stream" and not out.get("superStream"):
            for n in ("startingOffsets", "endingOffsets"):
                unknown = sorted(set(out[n]) - set(out["queue"])) if isinstance(out.get(n), dict) else []
                if unknown:
                    raise OptionError(n, json.dumps(out[n]), f"names {', '.join(unknown)}, which the option "
                                      f"'queue' does not list ({', '.join(out['queue'])})")
        if out.get("handoffPath") and out["handoff"] == "inline":
            raise OptionError("handoff", "inline", f"contradicts handoffPath={out['handoffPath']!r} (files "
                              "there): set one of the two")
        if out.get("bindingKeys") is not None and not out.get("exchange"):
            raise OptionError("bindingKeys", ",".join(out["bindingKeys"]), "needs the option 'exchange'")
    return out
