"""The shared core: what every rank of either system imports, and nothing of either system.

Grouped by concept:

- :mod:`mpipipe.core.mpi`: ranks and messages. The launch plan and roles (``roles``), tensor
  transport with deadlines (``transport``), ULFM failure notices (``ft``), spare ranks
  (``spare``), the progress watchdog (``watchdog``), the clean collective stop (``stop``),
  fault injection (``faults``) and the emulated testbed as a rank sees it (``testbed_nodes``).
- :mod:`mpipipe.core.state`: a stage's state as bytes (``statecodec``) and per-stage
  checkpoints (``checkpoint``).
- :mod:`mpipipe.core.logs`: the HDF5 run log (``runlog``), its schema (``logschema``) and what
  the printing rank shows (``progress``).
- :mod:`mpipipe.core.run`: what a run is made of and how it starts: the TOML configuration
  loader (``configfile``), the user's recipe (``recipe``, ``models``, ``chain``, ``lr``), the
  mini-batches from the shard store (``batches``), the command line both systems share
  (``cli``) and the Python API's shared part (``python_api``).
- :mod:`mpipipe.core.version`: the package's version.

`mpipipe.pipeline`, `mpipipe.respipe` and `stannis` build on it; it imports none of them, nor
the tools no rank imports (:mod:`mpipipe.tools`); tests/test_layers.py keeps it so.
"""
