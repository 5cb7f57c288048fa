"""The profiler: measures disk, RAM, host<->device links and matmul throughput of this machine."""
