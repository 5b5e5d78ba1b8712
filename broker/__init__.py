"""The embedded AMQP 0-9-1 broker: a sans-I/O protocol core (connection.py, channel.py, vhost.py, queue.py,
exchange.py) on the shared codec (`spark_amqp.codec`), with a thin asyncio server (server.py) around it.

Installed as `spark_amqp_broker` from the repository's `broker/` folder: a PyPI package named `broker`
exists, and installing ours under that name would shadow it.

    from spark_amqp_broker import Broker
    with Broker(port=0) as b:
        b.url
"""

from .config import BrokerConfig
from .embedded import Broker

__all__ = ["Broker", "BrokerConfig"]
