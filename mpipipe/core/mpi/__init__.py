"""Ranks and messages: roles, transport, ULFM, spare ranks, the watchdog, the collective stop, faults."""
