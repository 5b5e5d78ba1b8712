"""The embedded AMQP 0-9-1 broker: a sans-I/O protocol core (connection.py, channel.py, vhost.py,
queue.py, exchange.py) with a thin asyncio server (server.py) around it.

    from broker import Broker
    with Broker(port=0) as b:
        b.url
"""

from .config import BrokerConfig
from .embedded import Broker

__all__ = ["Broker", "BrokerConfig"]
