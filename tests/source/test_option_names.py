"""Option errors a user can act on (no Spark needed): an unknown option names the one meant."""

import pytest

from spark_amqp import options as opts

URI = "amqp://guest:secret-pw@127.0.0.1:5672/%2F"


@pytest.mark.parametrize("role, key, meant", [
    ("source", "maxOffsetsPerTrigger", "maxMessagesPerTrigger"),     # Spark's Kafka source's name
    ("source", "maxMessagePerTrigger", "maxMessagesPerTrigger"),     # a typo
    ("source", "subscribe", "queue"),
    ("source", "prefech", "prefetch"),
    ("sink", "routingkey_", "routingKey"),
    ("sink", "confirmTimout", "confirmTimeout"),
])
def test_an_unknown_option_suggests_the_known_one(role, key, meant):
    given = {"uri": URI, "queue": "q"} if role == "source" else {"uri": URI}
    with pytest.raises(opts.OptionError) as err:
        opts.parse({**given, key: "5"}, role)
    text = str(err.value)
    assert f"option '{key}'" in text and f"Did you mean '{meant}'?" in text
    assert "secret-pw" not in text


def test_no_suggestion_for_something_unrelated():
    with pytest.raises(opts.OptionError) as err:
        opts.parse({"uri": URI, "queue": "q", "colour": "blue"}, "source")
    assert "Did you mean" not in str(err.value) and "Known options: uri" in str(err.value)


@pytest.mark.parametrize("value", ["earliest", '{"s": -2}'])
def test_an_end_at_earliest_is_refused_as_kafkas_source_refuses_it(value):
    with pytest.raises(opts.OptionError) as err:
        opts.parse({"uri": URI, "queue": "s", "queueType": "stream", "endingOffsets": value}, "source")
    assert "option 'endingOffsets'" in str(err.value) and "cannot be earliest" in str(err.value)
    assert opts.parse({"uri": URI, "queue": "s", "queueType": "stream", "endingOffsets": '{"s": -1}'},
                      "source")["endingOffsets"] == {"s": -1}


def test_a_super_stream_is_read_in_stream_mode():
    parsed = opts.parse({"uri": URI, "superStream": "orders"}, "source")
    assert parsed["queueType"] == "stream" and parsed["queue"] is None


@pytest.mark.parametrize("role, given, option, words", [
    ("source", {"superStream": "orders", "queue": "q"}, "queue", "contradicts superStream='orders'"),
    ("source", {"superStream": "orders", "queueType": "quorum"}, "queueType", "read in stream mode"),
    ("source", {"superStreamPartitions": "a,b", "queue": "q"}, "superStreamPartitions", "needs the option"),
    ("source", {"queue": "q", "streamFilter": "eu"}, "streamFilter", "set queueType=stream"),
    ("source", {"queue": "q", "queueType": "stream", "streamMatchUnfiltered": "true"}, "streamMatchUnfiltered",
     "needs the option 'streamFilter'"),
    ("source", {}, "queue", "(or superStream)"),
    ("sink", {"superStream": "orders", "exchange": "x"}, "exchange", "contradicts superStream='orders'"),
])
def test_super_stream_and_filter_options_that_contradict_are_refused_naming_them(role, given, option, words):
    with pytest.raises(opts.OptionError) as err:
        opts.parse({"uri": URI, **given}, role)
    assert f"option '{option}'" in str(err.value) and words in str(err.value), str(err.value)
