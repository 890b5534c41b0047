"""What the test modules share: peers in processes of their own (peer), in
network namespaces (netns), cache bytes (cache_bytes), raw wire frames
(wire_frames) and the client sequences of upstream's users
(client_sequences). Imported as ``support.<module>`` (tests/ is on the path)."""
