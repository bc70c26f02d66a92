"""What a command run leaves on a shared server, and its cleanup.

That is a Redis namespace of the run.
"""

from __future__ import annotations

import uuid


def run_namespace(command: str) -> str:
    """A Redis key namespace of one run of ``command`` (``kvactors-<command>-<12 hex digits>``)."""
    return f"kvactors-{command}-{uuid.uuid4().hex[:12]}"


def drop_redis_namespace(url: str, namespace: str) -> None:
    """Delete the keys under ``namespace:`` (best effort, bounded by the client's timeouts)."""
    try:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=2.0)
        try:
            batch = list(client.scan_iter(match=f"{namespace}:*", count=1000))
            for i in range(0, len(batch), 1000):
                client.delete(*batch[i:i + 1000])
        finally:
            client.close()
    except Exception:  # best effort: the keys are under a namespace of this run only
        pass
