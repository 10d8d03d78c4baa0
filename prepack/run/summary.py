"""What a run did, in the lines ``prepack run`` prints at its end: batches, tokens, fill, the group
mix, drops and damaged input by reason, retried streams, and what ``--reuse`` saved."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.location import redact_uri
from schemas.manifest import StreamSummary


@dataclass
class RunSummary:
    out: str
    streams: list[StreamSummary]
    manifest_written: bool
    elapsed_s: float
    already_done: bool = False
    max_num_tokens: int = 0
    output_bytes: int = 0
    extra: dict = field(default_factory=dict)
    # what this run itself packed (resumed streams count only their new shards); None: all of ``streams``
    packed_now: tuple[int, int] | None = None  # (records, tokens)
    retried: str = ""  # a line naming the streams Ray retried, if any
    reuse_from: tuple[str, ...] = ()  # the --reuse packs

    def lines(self) -> list[str]:
        """What ``prepack run`` prints when it ends."""
        recs = sum(s.num_records for s in self.streams)
        toks = sum(s.num_tokens for s in self.streams)
        samples = sum(s.num_samples for s in self.streams)
        fill = toks / (recs * self.max_num_tokens) if recs and self.max_num_tokens else 0.0
        groups: dict[str, int] = {}
        drops: dict[str, int] = {}
        warns: dict[str, int] = {}
        for s in self.streams:
            for d, src in ((groups, s.group_samples), (drops, s.drops), (warns, s.warnings)):
                for k, v in src.items():
                    d[k] = d.get(k, 0) + v
        out = [
            f"{'already complete' if self.already_done else 'packed'}: {len(self.streams)} streams, {recs} batches, "
            f"{toks:,} tokens, {samples} samples -> {self.out}",
            f"fill ratio {fill:.3f} of max_num_tokens={self.max_num_tokens}; output {self.output_bytes / 2**20:.1f} MiB",
        ]
        if self.elapsed_s > 0 and not self.already_done:
            new_recs, new_toks = self.packed_now if self.packed_now is not None else (recs, toks)
            resumed = f"; {recs - new_recs} batches were already committed" if new_recs != recs else ""
            out.append(f"throughput {new_toks / self.elapsed_s:,.0f} tokens/s, {new_recs / self.elapsed_s:.2f} batches/s "
                       f"({self.elapsed_s:.1f} s wall{resumed})")
        total = sum(groups.values()) or 1
        out.append("group mix: " + ", ".join(f"{g} {n} ({n / total:.0%})" for g, n in sorted(groups.items())))
        out.append("drops: " + (", ".join(f"{k}={v}" for k, v in sorted(drops.items())) or "none"))
        if warns:
            out.append("damaged input packed as the reference does: " + ", ".join(f"{k}={v}" for k, v in sorted(warns.items())))
        if self.retried:
            out.append(self.retried)
        out.extend(self.reuse_lines())
        if not self.manifest_written:
            out.append("manifest not written yet: some streams of this config are still unpacked "
                       "(their committed shards are readable now)")
        return out

    def reuse_lines(self) -> list[str]:
        """``reused N of M images (P%) from OLD`` (the streams packed now), and fallbacks by reason."""
        images = sum(int(s.reuse.get("images", 0)) for s in self.streams)
        reused = sum(int(s.reuse.get("reused", 0)) for s in self.streams)
        fallbacks: dict[str, int] = {}
        for s in self.streams:
            for k, v in s.reuse.get("fallbacks", {}).items():
                fallbacks[k] = fallbacks.get(k, 0) + int(v)
        if not images or (not reused and not self.reuse_from and not fallbacks):
            return []
        where = " + ".join(redact_uri(r) for r in self.reuse_from) or "this pack's own shards"
        out = [f"reused {reused:,} of {images:,} images ({reused / images:.0%}) from {where}"]
        again = sum(int(s.reuse.get("frames_recompressed", 0)) for s in self.streams)
        if again:
            out.append(f"{again:,} reused images compressed again: OLD's frames are of another format than this "
                       "pack's compression (same bytes, more CPU)")
        if fallbacks:
            out.append("reuse fell back to decoding: " + ", ".join(f"{k}={v}" for k, v in sorted(fallbacks.items())))
        return out
