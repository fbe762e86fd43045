"""The embedded runtime (the ``[embedded]`` extra): a real Kafka-protocol broker and a real
redis-server as child processes, for ``ipdp up``, ``ipdp demo``, the tests and the benchmarks."""

from ipdp.embedded.children import free_port
from ipdp.embedded.runtime import EmbeddedRuntime
from ipdp.embedded.servers import (
    EmbeddedBroker,
    EmbeddedRedis,
    EmbeddedRedisCluster,
    find_redis_server,
    find_tansu,
)

__all__ = [
    "EmbeddedBroker",
    "EmbeddedRedis",
    "EmbeddedRedisCluster",
    "EmbeddedRuntime",
    "find_redis_server",
    "find_tansu",
    "free_port",
]
