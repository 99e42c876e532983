"""Serving calibration: vLLM served as a client sees it, measured and simulated.

``calibrate --engine vllm`` measures vLLM's prefill and decode steps and the connector's cost
through ``vllm serve`` (``steps``); ``validate --serve`` replays a ``bench serve`` run on the
serving simulator and sets its figures beside the measured ones (``sim``, ``validate``). Both
share the serving run's model: its workload (``workload``), its servers (``servers``), its
streaming client (``client``), the servers' counters (``counters``), the figures of a set of
requests (``measured``) and the host and model before a run (``host``). ``kvstrata bench serve``
(:mod:`kvstrata.bench.serve`) runs the same servers, workload and client as a benchmark.
"""
