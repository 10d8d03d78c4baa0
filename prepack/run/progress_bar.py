"""What the driver tells a person about a run: about the run, not about each stream.

Stream tasks report (batches, tokens, done, drop and warning counts, each kind's first example)
about once a second; ``RunProgress`` folds those into one progress line and announces each drop
reason or warning kind once per run, worded so its meaning is clear, however many streams meet
it.  Retried streams and lost nodes are announced once each.  Nothing here can fail a run: it
only reads what it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prepack.engine.accounting import Counters, meaning
from prepack.run.lease import format_streams


@dataclass(frozen=True)
class StreamProgress:
    """One stream's report to the driver: small, plain data (it crosses Ray as it is)."""

    stream: int
    batches: int
    tokens: int
    done: bool = False
    drops: dict[str, int] = field(default_factory=dict)  # reason -> count, as the packer counts them
    warnings: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)  # reason or kind -> its first occurrence

    @classmethod
    def of(cls, stream: int, batches: int, tokens: int, counters: Counters | None, done: bool = False) -> "StreamProgress":
        """A report from the packer's live counters (copied: the packer goes on counting)."""
        c = counters
        return cls(stream, batches, tokens, done, dict(c.drops) if c else {}, dict(c.warnings) if c else {},
                   dict(c.examples) if c else {})

    def counts(self, key: str) -> dict:
        """``drops`` or ``warnings``."""
        return self.drops if key == "drops" else self.warnings


@dataclass
class RunProgress:
    todo: list[int]
    budget: int | None  # batches per stream, when the budget is counted in batches
    knobs: dict
    streams: dict[int, StreamProgress] = field(default_factory=dict)  # stream -> its last report
    _announced: set[tuple[str, str]] = field(default_factory=set)
    _retries: dict[int, int] = field(default_factory=dict)

    def update(self, report: StreamProgress) -> None:
        old = self.streams.get(report.stream)
        if old is None or report.batches >= old.batches or report.done:
            self.streams[report.stream] = report

    @property
    def batches(self) -> int:
        return sum(p.batches for p in self.streams.values())

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.streams.values())

    def new_kinds(self) -> list[str]:
        """One line for each drop reason or warning kind seen for the first time in this run."""
        lines = []
        for key in ("drops", "warnings"):
            seen: dict[str, tuple[int, str]] = {}  # kind -> (first stream, its example)
            for s in sorted(self.streams):
                p = self.streams[s]
                for kind in p.counts(key):
                    seen.setdefault(kind, (s, p.examples.get(kind, "")))
            for kind, (s, example) in sorted(seen.items()):
                if (key, kind) in self._announced:
                    continue
                self._announced.add((key, kind))
                lines.append(f"{kind}: {meaning(kind, example, self.knobs, dropped=key == 'drops')} (first in "
                             f"stream {s}; counts in the summary, every occurrence with -v)")
        return lines

    def retried(self, attempts: dict[int, list[str]], dead_nodes: dict[str, str]) -> list[str]:
        """One line per new retry of a stream task: which stream, which attempt, and why."""
        lines = []
        for s, nodes in sorted(attempts.items()):
            if len(nodes) <= 1 or self._retries.get(s) == len(nodes):
                continue
            self._retries[s] = len(nodes)
            before = nodes[-2]
            why = (f"its node {dead_nodes[before]} was lost" if before in dead_nodes
                   else "its previous attempt ended before it could report (its worker or node was lost)"
                   if before == "?" else "its worker died")
            lines.append(f"stream {s} retried (attempt {len(nodes)} of its stream_task): {why}; it resumes after its "
                         "last committed shard")
        return lines

    @property
    def retried_streams(self) -> list[int]:
        return sorted(self._retries)

    def retry_summary(self) -> str:
        return (f"retried: stream{'s' if len(self._retries) > 1 else ''} {format_streams(self._retries)} "
                "(lost workers or nodes; each resumed after its last committed shard)") if self._retries else ""

    def postfix(self, elapsed: float) -> str:
        """Overall tokens and rate, then the per-stream spread (one line, whatever the number of streams)."""
        done = sum(1 for p in self.streams.values() if p.done)
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        counts = [self.streams[s].batches if s in self.streams else 0 for s in self.todo]
        of = f"/{self.budget}" if self.budget else ""
        if len(self.todo) <= 4:
            per = " ".join(f"s{s}:{c}{of}" for s, c in zip(self.todo, counts))
        else:
            per = f"per stream {min(counts)}..{max(counts)}{of}"
        return f"{self.tokens:,} tok, {rate:,.0f} tok/s, {per}, done {done}/{len(self.todo)}"
