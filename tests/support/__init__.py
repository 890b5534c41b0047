"""What the test modules share, imported as ``support.<module>`` (tests/ is on
the path):

- peer: engines in processes of their own, driven by commands;
- netns: such peers in network and PID namespaces (another "host");
- links: checks of linked peers (bytes both ways, the path, a peer killed
  mid-transfer), and the listener's connections;
- raw_client: a raw wire client and the listening engine it talks to;
- wire_frames: the wire's frames, built and read by hand;
- device: device-memory scenarios on the CUDA driver stand-in, in spawned
  processes;
- options: options of an engine in the test's own process;
- cache_bytes: a cache's bytes, filled and read;
- client_sequences: the call sequences of upstream's users.
"""
