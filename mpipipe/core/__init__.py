"""The shared core: ranks and messages, and nothing of either system.

Launch plan and roles, tensor transport with deadlines, ULFM failure notices, faults,
the HDF5 run log, configuration, launch, the command line, progress, checkpoints, the
state codec, models and data. `mpipipe.pipeline`, `mpipipe.respipe` and `stannis` build on
it; it imports none of them (tests/test_layers.py keeps it so).
"""
