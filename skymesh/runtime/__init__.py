"""Process runtime shared by every skymesh daemon: logging, GC settings, supervised loops,
child processes, config-reload planning, the Prometheus text reader the prober uses, and
the protobuf code generator."""
