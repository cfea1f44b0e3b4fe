"""Tools no rank imports: the testbed emulator, the chaos campaign runner, the MPI launcher, the log plots.

They start jobs, bring up emulated clusters and draw run logs, around the ranks, never inside
one (tests/test_layers.py checks that a trainer's imports hold none of them). They import
:mod:`mpipipe.core` and native only; the commands, the systems' chaos plugins and
``stannis.plots`` import them.
"""
