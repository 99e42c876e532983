"""Where observations come from: a server's ``/metrics``, a saved dump of it, or a
``kvstrata bench serve --json`` report (the edge: network, files, text formats).

Metrics text is parsed with ``prometheus_client``'s parser; every series is summed over the
labels that name an engine or a model (``engine``, ``model_name``), so a server with several
engines reads as one. Anything wrong with a source is one :class:`SourceError` whose message
names the source and what was wrong with it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvstrata.doctor.observation import (
    ConnectorCounters,
    Histogram,
    Leg,
    Observation,
    RequestSample,
    TierCounters,
    VllmCounters,
)
from kvstrata.extras import require
from kvstrata.media import Medium

CONNECTOR = "kvstrata_connector_"
VLLM = "vllm:"
FETCH_TIMEOUT_S = 10.0


class SourceError(ValueError):
    """A source that cannot be read or is not what the doctor reads (one line, naming it)."""


class Samples:
    """One or more metrics texts' samples, summed over engines (and over servers when several)."""

    def __init__(self) -> None:
        # sample name -> [(labels other than engine and model, value)]
        self._by_name: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        self._cumulative: set[str] = set()  # names of counters' and histograms' samples (they only grow)
        self.models: set[str] = set()

    @classmethod
    def parse(cls, texts: list[str], source: str) -> Samples:
        """Parse ``texts`` (Prometheus text format).

        Raises:
            SourceError: a text that is not in the format.
        """
        out = cls()
        parser = require("prometheus_client.parser", "reading Prometheus metrics text")
        for text in texts:
            try:
                families = list(parser.text_string_to_metric_families(text))
            except ValueError as exc:
                raise SourceError(f"{source}: not Prometheus metrics text ({exc})") from None
            for family in families:
                for s in family.samples:
                    if "model_name" in s.labels:
                        out.models.add(s.labels["model_name"])
                    labels = {k: v for k, v in s.labels.items() if k not in ("engine", "model_name")}
                    out._by_name[s.name].append((labels, s.value))
                    if family.type in ("counter", "histogram", "summary") and not s.name.endswith("_created"):
                        out._cumulative.add(s.name)
        return out

    def since(self, earlier: Samples, source: str) -> Samples:
        """What happened between ``earlier`` and these samples: counters and histograms are
        the differences, gauges (tiers' fill, vLLM's config) are these.

        Raises:
            SourceError: a counter went down (the server restarted in between).
        """
        out = Samples()
        out.models, out._cumulative = set(self.models), set(self._cumulative)
        for name, samples in self._by_name.items():
            if name not in self._cumulative:
                out._by_name[name] = list(samples)
                continue
            before = _summed(earlier._by_name.get(name, ()))
            for key, value in _summed(samples).items():
                delta = value - before.get(key, 0.0)
                if delta < -1e-9 * max(1.0, abs(value)):
                    raise SourceError(f"{source}: {name} went down since the earlier dump (the server restarted "
                                      "in between?): a window needs two dumps of one run")
                out._by_name[name].append((dict(key), max(0.0, delta)))
        return out

    def has_prefix(self, prefix: str) -> bool:
        return any(name.startswith(prefix) for name in self._by_name)

    def has(self, name: str) -> bool:
        return name in self._by_name

    def total(self, name: str, **match: str) -> float:
        """The sum of ``name``'s samples whose labels include ``match``."""
        return sum(v for labels, v in self._by_name.get(name, ()) if all(labels.get(k) == x for k, x in match.items()))

    def by(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        """``name``'s samples summed per value of the labels ``keys``."""
        out: dict[tuple[str, ...], float] = defaultdict(float)
        for labels, v in self._by_name.get(name, ()):
            if all(k in labels for k in keys):
                out[tuple(labels[k] for k in keys)] += v
        return dict(out)

    def labels(self, name: str) -> list[dict[str, str]]:
        return [labels for labels, _ in self._by_name.get(name, ())]

    def histogram(self, name: str) -> Histogram | None:
        """The histogram ``name`` (its ``_bucket``, ``_count`` and ``_sum`` samples); None: absent."""
        if not self.has(f"{name}_count"):
            return None
        buckets = sorted((float(le), v) for (le,), v in self.by(f"{name}_bucket", "le").items())
        return Histogram(tuple(buckets), self.total(f"{name}_count"), self.total(f"{name}_sum"))


def _summed(samples) -> dict[frozenset, float]:
    out: dict[frozenset, float] = defaultdict(float)
    for labels, value in samples:
        out[frozenset(labels.items())] += value
    return out


def observation(samples: Samples, source: str, requests: tuple[RequestSample, ...] = ()) -> Observation:
    """What ``samples`` say about one server (or several summed).

    Raises:
        SourceError: neither vLLM's series nor kvstrata's connector's are there.
    """
    vllm = _vllm(samples) if samples.has_prefix(VLLM) else None
    conn = _connector(samples) if samples.has_prefix(CONNECTOR) else None
    if vllm is None and conn is None:
        raise SourceError(f"{source}: metrics, but not a vLLM server's (no {VLLM} or {CONNECTOR} series)")
    model = sorted(samples.models)[0] if samples.models else None
    return Observation(source, model, vllm, conn, requests)


def _medium(label: str) -> Medium | None:
    try:
        return Medium[label.upper()]
    except KeyError:
        return None  # a tier this kvstrata does not know: not ours to judge


def _connector(s: Samples) -> ConnectorCounters:
    c = CONNECTOR
    per_tier = {
        field: s.by(f"{c}{name}", "tier")
        for field, name in (("hit_blocks", "lookup_hit_blocks_total"), ("loaded_blocks", "loaded_blocks_total"),
                            ("loaded_bytes", "loaded_bytes_total"), ("evicted_blocks", "evicted_blocks_total"),
                            ("used_bytes", "tier_used_bytes"), ("capacity_bytes", "tier_capacity_bytes"),
                            ("declined_blocks", "declined_blocks_total"))
    }
    evictions_reported = s.has(f"{c}evicted_blocks_total")
    labels = sorted({label for values in per_tier.values() for (label,) in values},
                    key=lambda x: (_medium(x).value if _medium(x) is not None else 99))
    tiers = []
    for label in labels:
        medium = _medium(label)
        if medium is None:
            continue
        key = (label,)
        tiers.append(TierCounters(
            medium,
            hit_blocks=per_tier["hit_blocks"].get(key, 0.0),
            loaded_blocks=per_tier["loaded_blocks"].get(key, 0.0),
            loaded_bytes=per_tier["loaded_bytes"].get(key, 0.0),
            evicted_blocks=per_tier["evicted_blocks"].get(key, 0.0) if evictions_reported else None,
            used_bytes=per_tier["used_bytes"].get(key),
            capacity_bytes=per_tier["capacity_bytes"].get(key),
            declined_blocks=per_tier["declined_blocks"].get(key, 0.0),
        ))
    moved, seconds = s.by(f"{c}moved_bytes_total", "src", "dst"), s.by(f"{c}transfer_seconds_total", "src", "dst")
    legs = []
    for (src, dst), nbytes in sorted(moved.items()):
        a, b = _medium(src), _medium(dst)
        if a is not None and b is not None:
            legs.append(Leg(a, b, nbytes, seconds.get((src, dst), 0.0)))
    return ConnectorCounters(
        tiers=tuple(tiers),
        legs=tuple(legs),
        miss_blocks=s.total(f"{c}lookup_miss_blocks_total"),
        loads=s.total(f"{c}loads_total"),
        load_seconds=s.total(f"{c}load_seconds_total"),
        stored_blocks=s.total(f"{c}stored_blocks_total"),
        store_seconds=s.total(f"{c}store_seconds_total"),
        load_failed_blocks=s.total(f"{c}load_failed_blocks_total"),
        recomputed_blocks=s.total(f"{c}recomputed_blocks_total"),
    )


def _vllm(s: Samples) -> VllmCounters:
    v = VLLM
    prompts = s.histogram(f"{v}request_prompt_tokens")
    requests = prompts.count if prompts is not None else s.total(f"{v}request_success_total")
    block_tokens = kv_tokens = None
    for labels in s.labels(f"{v}cache_config_info"):  # one per engine; each engine's own KV memory
        block_tokens = _int(labels.get("block_size")) or block_tokens
        tokens = _int(labels.get("kv_cache_size_tokens"))
        if tokens is None and block_tokens and _int(labels.get("num_gpu_blocks")):
            tokens = block_tokens * _int(labels.get("num_gpu_blocks"))
        kv_tokens = max(kv_tokens or 0, tokens or 0) or None
    return VllmCounters(
        requests=requests,
        prompt_tokens=s.total(f"{v}prompt_tokens_total") or (prompts.total if prompts is not None else 0.0),
        prefix_queries_tokens=s.total(f"{v}prefix_cache_queries_total"),
        prefix_hits_tokens=s.total(f"{v}prefix_cache_hits_total"),
        external_queries_tokens=s.total(f"{v}external_prefix_cache_queries_total"),
        external_hits_tokens=s.total(f"{v}external_prefix_cache_hits_total"),
        block_tokens=block_tokens,
        kv_cache_tokens=kv_tokens,
        prompt_tokens_hist=prompts,
        computed_tokens_hist=s.histogram(f"{v}request_prefill_kv_computed_tokens"),
        prefill_seconds_hist=s.histogram(f"{v}request_prefill_time_seconds"),
        ttft_hist=s.histogram(f"{v}time_to_first_token_seconds"),
    )


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


# --- sources -------------------------------------------------------------------------------


def read(where: str, timeout_s: float = FETCH_TIMEOUT_S, since: str | None = None) -> list[Observation]:
    """The observations of ``where``: a URL (``http://host:port``, its ``/metrics`` then), a
    metrics dump file, or a ``bench serve --json`` report (one observation per server).

    ``since``: an earlier metrics dump of the same server (a file); the observation is then of
    what happened after it (a window), not since the server started.

    Raises:
        SourceError: no answer, no such file, or not metrics nor a bench report; a ``since``
            with a bench report, or one from before a restart.
    """
    earlier = Samples.parse([_text(since)], since) if since is not None else None
    if where.startswith(("http://", "https://")):
        url = metrics_url(where)
        samples = Samples.parse([fetch(url, timeout_s)], url)
        return [observation(samples.since(earlier, url) if earlier is not None else samples, url)]
    text = _text(where)
    if text.lstrip().startswith(("{", "[")):
        if earlier is not None:
            raise SourceError(f"{where}: a bench serve report has its own window (its servers' whole runs); "
                              "--since is for a metrics dump or a URL")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SourceError(f"{where}: looks like JSON but is not ({exc})") from None
        return from_bench(doc, where)
    samples = Samples.parse([text], where)
    return [observation(samples.since(earlier, where) if earlier is not None else samples, where)]


def _text(where: str) -> str:
    path = Path(where)
    if not path.is_file():
        raise SourceError(f"{where}: no such file (give a /metrics URL, a metrics dump or a bench serve --json report)")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"{where}: cannot read it as text ({exc})") from None


def metrics_url(url: str) -> str:
    """``url`` itself, or its ``/metrics`` where it names only a server (no path)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/metrics")) if parts.path in ("", "/") else url


def fetch(url: str, timeout_s: float = FETCH_TIMEOUT_S) -> str:
    """``url``'s body as text.

    Raises:
        SourceError: no answer within ``timeout_s``, or not 200.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return answer.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        raise SourceError(f"{url}: answered HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SourceError(f"{url}: no answer ({reason})") from None


def from_bench(doc: Any, source: str) -> list[Observation]:
    """One observation per server of a ``kvstrata bench serve --json`` report.

    Found by shape: an object holding ``metrics_text``. Where that is an object of texts (the
    report's ``{server: its final /metrics}``), each entry is a server, named by its key, and
    its requests are those of the report's figures under the same key (``"kvstrata":
    {"requests": [...]}``); where it is one text (or a list of texts, summed), the object is one
    configuration, named by its ``name`` (else ``config`` or ``label``, else the key it sits
    under), its requests inside it. Requests: the first list of objects with ``prompt_tokens``
    and ``ttft_s``. Where some servers have the connector's series, those without are the
    report's baselines (vLLM alone, on purpose).

    Raises:
        SourceError: no ``metrics_text`` in it.
    """
    found = list(_configs(doc, ""))
    if not found:
        raise SourceError(f"{source}: JSON, but not a `kvstrata bench serve --json` report (no metrics_text in it)")
    out = []
    for name, config in found:
        texts = config["metrics_text"]
        if isinstance(texts, dict):
            for server, text in texts.items():
                if isinstance(text, str):
                    label = f"{source} [{server}]"
                    out.append(observation(Samples.parse([text], label), label, _requests(config.get(server))))
            continue
        label = f"{source} [{name}]" if name else source
        texts = [texts] if isinstance(texts, str) else [t for t in texts if isinstance(t, str)] \
            if isinstance(texts, list) else []
        out.append(observation(Samples.parse(texts, label), label, _requests(config)))
    if any(o.connector is not None for o in out):  # the servers without it are the baselines
        out = [replace(o, baseline=True) if o.connector is None else o for o in out]
    return out


def _configs(doc: Any, key: str) -> Iterator[tuple[str, dict]]:
    if isinstance(doc, dict):
        if "metrics_text" in doc:
            name = next((str(doc[k]) for k in ("name", "config", "label") if isinstance(doc.get(k), str)), key)
            yield name, doc
            return
        for k, v in doc.items():
            yield from _configs(v, str(k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _configs(v, f"{key}[{i}]" if key else str(i))


def _requests(config: Any) -> tuple[RequestSample, ...]:
    def lists(x: Any) -> Iterator[list]:
        if isinstance(x, list):
            yield x
            for v in x:
                if isinstance(v, (dict, list)):
                    yield from lists(v)
        elif isinstance(x, dict):
            for k, v in x.items():
                if k != "metrics_text":
                    yield from lists(v)

    for items in lists(config):
        rows = [r for r in items if isinstance(r, dict) and isinstance(r.get("prompt_tokens"), (int, float))
                and isinstance(r.get("ttft_s"), (int, float))]
        if rows:
            return tuple(RequestSample(int(r["prompt_tokens"]), float(r["ttft_s"])) for r in rows)
    return ()
