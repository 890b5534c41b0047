"""``python -m datadist_aio.bench``: KV-cache transfer throughput and latency
between two processes (or hosts), against raw TCP and memcpy measured in the
same run, and optionally against Mooncake Transfer Engine and NIXL."""
