"""free_port: the ports that LocalCluster and the tests hand to processes started later."""

import socket

from services.common.redis_server import _ephemeral_range, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_free():
    """A process that binds ``free_port()``'s port later must find it free: the OS gives
    ``bind(0)`` callers (vLLM's own ports, other helpers) only ephemeral ports, so a port
    below that range cannot be taken by them meanwhile (a vLLM worker once lost its
    metrics port that way); and one process never gets the same port twice."""
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < p < low for p in ports)
    taken = [socket.socket() for _ in range(200)]  # the OS's own choices meanwhile
    try:
        for s in taken:
            s.bind(("127.0.0.1", 0))
        assert not {s.getsockname()[1] for s in taken} & set(ports)
        with socket.socket() as s:
            s.bind(("127.0.0.1", ports[0]))  # still free for its process
    finally:
        for s in taken:
            s.close()
