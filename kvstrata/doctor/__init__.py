"""``kvstrata doctor``: "I see no speedup: why?" for a vLLM server running the connector.

An :class:`~kvstrata.doctor.observation.Observation` (a server's counters, read at the edge by
:mod:`kvstrata.doctor.sources`) and the hardware model's
:class:`~kvstrata.doctor.expect.Expectations` go into :func:`~kvstrata.doctor.analyze.diagnose`,
a pure function; out comes a :class:`~kvstrata.doctor.findings.Diagnosis`: per tier its hit rate
and restore rate against the prediction, and findings, each with the one change most likely to
help.
"""
