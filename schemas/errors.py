"""Every error a user can cause or meet, in one place, under one base class.

``PrepackError`` and its subclasses carry a message meant for the user: the CLI prints it as one
line and exits with ``exit_code`` (2 for a mistake in the command or config, 1 when the work
failed or was refused).  Anything else that escapes is a bug: the CLI prints its traceback.
Both the packer and the loader raise these, so they live in ``schemas`` (imported by both).
"""

from __future__ import annotations


class PrepackError(Exception):
    """Base of every user-facing error; ``str(e)`` is the one line to show."""

    exit_code = 1


class UsageError(PrepackError, ValueError):
    """Bad command-line arguments."""

    exit_code = 2


class CredentialsInUri(UsageError):
    """A URI carries a secret (user:password@, or a key/token query parameter): refused, never echoed."""


class ConfigError(PrepackError, ValueError):
    """The config is invalid (unknown key, wrong type, impossible value, missing source)."""

    exit_code = 2


class NotAPack(PrepackError, FileNotFoundError):
    """A directory holds no pack (no ``pack.json``)."""


class PackFormatError(PrepackError, ValueError):
    """A pack of another on-disk version: this code cannot read it."""


class PackIntegrityError(PrepackError, RuntimeError):
    """A file of a pack does not hold what its index says; names the file and the record."""

    def __init__(self, path: str, stream: int, record: int, reason: str):
        super().__init__(f"{path}: stream {stream}, record {record}: {reason}")
        self.path, self.stream, self.record, self.reason = path, stream, record, reason


class DamagedFile(PrepackError, RuntimeError):
    """A metadata file of a pack (checkpoint, index, lineage) is damaged; names the file."""


class PackRefused(PrepackError, RuntimeError):
    """A run must not start: another run leases its streams, or the output holds another config's pack."""


class LeaseLost(PackRefused):
    """Another run took over this run's stream lease (``prepack.run.lease``): this one must stop."""


class AuditRefused(PrepackError, RuntimeError):
    """An audit cannot run: different code, tokenizer or config, or unreachable sources."""


class StreamFailed(PrepackError, RuntimeError):
    """A stream's packing task failed; the message names the stream and the cause."""


class SourceStalled(PrepackError, RuntimeError):
    """A group yields no sample for a whole pass (the reference would loop forever)."""


class PackingError(PrepackError, RuntimeError):
    """The packer cannot go on (e.g. batches refused too many times in a row)."""


class ShardTrimmed(PrepackError, RuntimeError):
    """A committed shard's records file was trimmed (``prepack trim``): its index, digests and
    checkpoint stay, and ``prepack restore`` packs it again byte for byte."""


class FollowTimeout(PrepackError, TimeoutError):
    """A followed stream got no new committed shard within the timeout."""


class MissingLatents(PrepackError, RuntimeError):
    """A loader asked for VAE latents (``vae_latents=True``) reached a shard whose latents were not
    written (``prepack latents``), or whose latents do not belong to it."""


class DiskBudgetTooSmall(PrepackError, RuntimeError):
    """A stream's share of ``--disk-budget`` cannot hold what no trim frees and its next shard's most:
    it would wait for good; the message gives the smallest budget that works."""
