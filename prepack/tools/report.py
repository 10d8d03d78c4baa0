"""A report of checks as a plain-text table: what ``verify`` and ``audit`` print."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CheckRow:
    """One line of a report: what was checked, on what, and the outcome."""

    check: str
    target: str
    ok: bool
    detail: str = ""


@dataclass
class CheckReport:
    """Rows of checks; ``ok`` only when every row passed.  ``lines()`` renders a plain-text table."""

    title: str
    rows: list[CheckRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    def add(self, check: str, target: str, ok: bool, detail: str = "") -> bool:
        self.rows.append(CheckRow(check, target, ok, detail))
        return ok

    def failures(self) -> list[CheckRow]:
        return [r for r in self.rows if not r.ok]

    def lines(self) -> list[str]:
        wc = max([len("CHECK")] + [len(r.check) for r in self.rows])
        wt = max([len("TARGET")] + [len(r.target) for r in self.rows])
        out = [self.title, f"{'CHECK':<{wc}}  {'TARGET':<{wt}}  RESULT  DETAIL"]
        for r in self.rows:
            out.append(f"{r.check:<{wc}}  {r.target:<{wt}}  {'ok' if r.ok else 'FAIL':<6}  {r.detail}".rstrip())
        bad = self.failures()
        verdict = "OK" if self.ok else "FAILED"
        out.append(f"{verdict}: {len(self.rows) - len(bad)} of {len(self.rows)} checks passed")
        return out
