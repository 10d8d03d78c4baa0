"""Who fetches a source object from a store: one client per (scheme, bucket) and process.

Packing reads thousands of objects per stream (images, videos, parquet row groups), and on a store
the client's own CPU per request is paid on the packing core.  pyarrow's S3 filesystem (the AWS C++
SDK) sends a HEAD before each GET and copies the body through its streams; obstore (Rust
``object_store``) reads the same object with one GET, for about a third of the CPU (measured:
docs/performance.md, "Object stores (S3)").  So source reads on ``s3://`` go through obstore when
it can serve the bucket, and through pyarrow otherwise; listings, the pack's own output and the
loader stay on pyarrow.

Both clients return the same bytes, and fail the same way for the sources: ``FileNotFoundError``
for a missing object, ``PermissionError`` for a refused one, ``OSError`` for anything else, each
naming the URI, so a source drops a bad object by the same rule whichever client read it.

``PREPACK_OBJECT_CLIENT`` (``auto``, ``obstore``, ``pyarrow``) chooses; ``auto`` takes obstore
for ``s3://`` when it is installed and the credentials are where ``object_store`` looks
(environment keys, web identity, container or instance credentials), and pyarrow when they come
from a named profile or a shared credentials file, which ``object_store`` does not read.  If
obstore's first request to a bucket fails for any reason but a missing object while pyarrow's
succeeds, that bucket is read with pyarrow from then on (logged once).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Any, Protocol

import pyarrow.fs as pafs

from schemas.errors import ConfigError

log = logging.getLogger(__name__)

Buffer = Any  # an object with the buffer protocol (obstore's ``Bytes``): what parquet's ranged reads hand pyarrow

CLIENT_ENV = "PREPACK_OBJECT_CLIENT"
CLIENTS = ("auto", "obstore", "pyarrow")


class ObjectClient(Protocol):
    """Reads of whole objects and byte ranges inside one bucket; keys are ``bucket/key``."""

    name: str

    def get(self, key: str) -> bytes: ...

    def get_range(self, key: str, start: int, end: int) -> "bytes | Buffer":
        """Bytes ``[start, end)`` (fewer only at the object's end); a buffer, not always ``bytes``."""

    def tail(self, key: str, n: int) -> "tuple[bytes | Buffer, int]":
        """The last ``n`` bytes (all of a smaller object) and the object's size, in one request where the store allows."""


def _uri(scheme: str, key: str) -> str:
    return f"{scheme}://{key}"


class PyarrowObjects:
    """pyarrow's filesystem: what every scheme it knows falls back to."""

    name = "pyarrow"

    def __init__(self, fs: pafs.FileSystem):
        self._fs = fs

    def get(self, key: str) -> bytes:
        with self._fs.open_input_stream(key) as f:
            return f.read()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with self._fs.open_input_file(key) as f:
            return f.read_at(max(0, end - start), start)

    def tail(self, key: str, n: int) -> tuple[bytes, int]:
        with self._fs.open_input_file(key) as f:
            size = f.size()
            start = max(0, size - n)
            return f.read_at(size - start, start), size


class ObstoreObjects:
    """One bucket through obstore: whole objects in one GET, ranges in one ranged GET each."""

    name = "obstore"

    def __init__(self, bucket: str, region: str | None, env: "dict[str, str] | None" = None):
        import obstore  # an ImportError here means: use pyarrow
        from obstore import exceptions
        from obstore.store import S3Store

        env = os.environ if env is None else env
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        kwargs: dict = {}
        if region:
            kwargs["region"] = region
        if endpoint:  # a custom store (MinIO, SeaweedFS, ...): path-style requests, as pyarrow sends them
            kwargs["endpoint"] = endpoint
            kwargs["virtual_hosted_style_request"] = False
        else:  # AWS itself: virtual-hosted requests, as pyarrow sends them
            kwargs["virtual_hosted_style_request"] = True
        client_options = {"allow_http": bool(endpoint and endpoint.startswith("http://"))}
        self._get, self._errors = obstore.get, exceptions  # imported once, not per request
        self._bucket = bucket
        self._store = S3Store(bucket, client_options=client_options, **kwargs)

    def _call(self, key: str, **options):
        ox = self._errors
        bucket, _, path = key.partition("/")
        if bucket != self._bucket:
            raise ValueError(f"{key}: not in bucket {self._bucket}")
        try:
            return self._get(self._store, path, options=options or None)
        except ox.NotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such object", _uri("s3", key)) from None
        except (ox.PermissionDeniedError, ox.UnauthenticatedError) as e:
            raise PermissionError(errno.EACCES, f"access refused ({_first_line(e)})", _uri("s3", key)) from None
        except ox.BaseError as e:
            raise OSError(errno.EIO, _first_line(e), _uri("s3", key)) from None

    def get(self, key: str) -> bytes:
        return bytes(self._call(key).bytes())

    def get_range(self, key: str, start: int, end: int) -> "bytes | Buffer":
        if end <= start:
            return b""
        return self._call(key, range=(start, end)).bytes()  # obstore's buffer: pyarrow reads it without a copy

    def tail(self, key: str, n: int) -> "tuple[bytes | Buffer, int]":
        result = self._call(key, range={"suffix": n})
        return result.bytes(), int(result.meta["size"])


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class _FirstUseFallback:
    """obstore, unless its first request fails where pyarrow's succeeds: then pyarrow for good."""

    def __init__(self, primary: ObjectClient, fallback: ObjectClient, where: str):
        self._primary = primary
        self._fallback = fallback
        self._where = where
        self._lock = threading.Lock()
        self._settled: ObjectClient | None = None

    @property
    def name(self) -> str:
        return (self._settled or self._primary).name

    def _do(self, method: str, *args):
        settled = self._settled
        if settled is not None:
            return getattr(settled, method)(*args)
        try:
            value = getattr(self._primary, method)(*args)
        except FileNotFoundError:
            raise  # the object is missing, not the client at fault: decide on a later request
        except OSError as e:
            try:
                value = getattr(self._fallback, method)(*args)
            except Exception:
                raise e from None  # both fail: the object (or the store) is at fault; decide later
            with self._lock:
                if self._settled is None:
                    log.info("%s: obstore could not read it (%s); reading it with pyarrow", self._where, e)
                    self._settled = self._fallback
            return value
        with self._lock:
            if self._settled is None:
                self._settled = self._primary
        return value

    def get(self, key: str) -> bytes:
        return self._do("get", key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._do("get_range", key, start, end)

    def tail(self, key: str, n: int) -> tuple[bytes, int]:
        return self._do("tail", key, n)


def choice(env: "dict[str, str] | None" = None) -> str:
    """``PREPACK_OBJECT_CLIENT``, checked."""
    env = os.environ if env is None else env
    value = env.get(CLIENT_ENV, "auto").strip().lower() or "auto"
    if value not in CLIENTS:
        raise ConfigError(f"{CLIENT_ENV}={value!r}: use one of {', '.join(CLIENTS)}")
    return value


def credentials_from_profile(env: "dict[str, str] | None" = None) -> bool:
    """Whether the AWS credentials come from a profile or a shared credentials file (no keys in the environment)."""
    env = os.environ if env is None else env
    if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE") \
            or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return False
    if env.get("AWS_PROFILE"):
        return True
    home = env.get("HOME") or os.path.expanduser("~")
    shared = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")
    return os.path.isfile(shared)


def make_client(scheme: str, authority: str, fs: pafs.FileSystem,
                env: "dict[str, str] | None" = None) -> ObjectClient:
    """The client for one (scheme, bucket), by ``PREPACK_OBJECT_CLIENT`` (see the module docstring)."""
    env = os.environ if env is None else env
    want = choice(env)
    pyarrow_client = PyarrowObjects(fs)
    if scheme != "s3" or want == "pyarrow" or (want == "auto" and credentials_from_profile(env)):
        return pyarrow_client
    region = getattr(fs, "region", None)
    try:
        primary = ObstoreObjects(authority, region, env)
    except ImportError:
        if want == "obstore":
            raise ConfigError(f"{CLIENT_ENV}=obstore but obstore is not installed (pip install obstore)") from None
        log.info("obstore is not installed: s3://%s is read with pyarrow", authority)
        return pyarrow_client
    except Exception as e:  # a configuration obstore refuses (pyarrow may still take it)
        if want == "obstore":
            raise ConfigError(f"{CLIENT_ENV}=obstore: cannot use s3://{authority} ({_first_line(e)})") from None
        log.info("obstore cannot use s3://%s (%s): it is read with pyarrow", authority, _first_line(e))
        return pyarrow_client
    if want == "obstore":
        return primary
    return _FirstUseFallback(primary, pyarrow_client, f"s3://{authority}")
